"""What flow control checks when a config names files (read before it applies) and when a replica says what it
serves (and, when it exports it, its KV pool).

A calibration profile holds only for the model and runtime it was measured on: any other replica is refused
(its estimate would be false headroom) until it matches. And the hard watermark must leave one scheduling cycle
of growth in the replica's real pool, which the config could only check against the configured one.
"""

from __future__ import annotations

import logging

from gateway.calibration import Profile, load_profile
from gateway.log import log_event
from gateway.policies.admission import KvAdmission, reported_pool_tokens
from gateway.replicas import Replica
from gateway.settings import GatewayConfig
from gateway.tokenization import load_local_tokenizer

logger = logging.getLogger("gateway.flow")


def check_files(cfg: GatewayConfig) -> Profile | None:
    """The files a config names, read (a ConfigError when one cannot be): its calibration profile, returned,
    and its tokenizer file."""
    adm = cfg.admission
    profile = load_profile(adm.calibrationProfile) if adm.calibrationProfile else None
    if adm.enabled and adm.tokenizer in ("local", "auto") and adm.tokenizerFile:
        load_local_tokenizer(adm.tokenizerFile)
    return profile


def check_identified(replica: Replica, cfg: GatewayConfig, profile: Profile | None,
                     admission: KvAdmission | None) -> bool:
    """A replica told us what it serves and (when exported) its KV pool: check both against the config; True when
    it now takes work, or no longer does."""
    changed = profile is not None and refuse_unmeasured(profile, replica, cfg.admission.calibrationProfile)
    if admission is not None:
        warn_short_growth_room(admission, replica, cfg)
    return changed


def refuse_unmeasured(profile: Profile, replica: Replica, profile_path: str | None) -> bool:
    """Refuse `replica` when the profile was not measured on it, accept it again when it was; True when that
    verdict changed (the replica now takes work, or no longer does)."""
    reason = profile.mismatch(replica)
    if reason == replica.refused:
        return False
    replica.refused = reason
    log_event(logger, "calibration_refused" if reason else "calibration_accepted",
              level=logging.ERROR if reason else logging.INFO, replica=replica.url,
              reason=reason, profile=profile_path,
              hint=(f"a vLLM upgrade or another model needs a new profile: run `holdback gateway calibrate --replica "
                    f"{replica.url} --gpu SKU --out FILE` on it while idle, point admission.calibrationProfile at "
                    "FILE and reload (SIGHUP); or remove admission.calibrationProfile to reserve with "
                    "admission.safetyFactor") if reason else None)
    return True


def warn_short_growth_room(admission: KvAdmission, replica: Replica, cfg: GatewayConfig) -> None:
    """Log `kv_growth_room_short` when the replica's reported pool leaves less than one scheduling cycle of growth
    (one block per running sequence) above the hard watermark."""
    block_size = admission.block_size(replica)
    pool = reported_pool_tokens(replica, block_size)
    if not pool:
        return
    adm = cfg.admission
    running = adm.maxRunningSequences or replica.max_num_seqs or cfg.saturation.maxConcurrency
    pool_blocks = pool // block_size
    room = adm.growth_room(pool_blocks)
    if room < running:
        # The config passed its check against the configured pool; this replica's real pool is smaller.
        log_event(logger, "kv_growth_room_short", level=logging.WARNING, replica=replica.url,
                  pool_blocks=pool_blocks, block_size=block_size, room_blocks=room, running_sequences=running,
                  hint="lower admission.hardWatermark or admission.maxRunningSequences")
