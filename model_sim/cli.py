"""`holdback sim`: run N simulated vLLM replicas on consecutive ports in one process.

Replica i listens on --port + i and answers with `x-sim-replica: i`. SIGTERM or SIGINT aborts
in-flight requests and stops every replica cleanly.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from model_sim.config import EngineConfig, Runner, SimConfig
from model_sim.faults import FaultSettings
from model_sim.generation import OutputLengthMode
from model_sim.replica import SimReplica
from model_sim.request_queue import SchedulingPolicy
from model_sim.timing import TimingModel
from holdback.env_flags import flags_from_env
from holdback.logs import configure_json_logging, log_event

log = logging.getLogger("model_sim")

_DEFAULT_TIMING = TimingModel()
_DEFAULT_ENGINE = EngineConfig()


class _DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, except where there is none to show: a required flag, or an unset one whose
    help says what unset means (argparse would print "(default: None)")."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.required or action.default is None:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="holdback sim",
        description=(
            "Simulated vLLM replicas (OpenAI API, vLLM metrics, continuous batching, KV blocks, preemption, "
            "abort on disconnect). Each engine step takes  step_overhead + prefill_tokens * prefill_per_token "
            "+ (decode_seqs > 0) * (decode_base + decode_per_seq * decode_seqs)."
        ),
        epilog=(
            "Endpoints: /v1/chat/completions /v1/completions /v1/embeddings /v1/models /tokenize /detokenize "
            "/health /metrics, GET /admin/state, GET|POST /admin/faults. Header x-sim-force-error: STATUS forces "
            "an error answer. See model_sim/README.md."
        ),
        formatter_class=_DefaultsHelp,
    )
    srv = p.add_argument_group("server")
    srv.add_argument("--port", type=int, required=True, help="port of replica 0; replica i uses PORT+i (required)")
    srv.add_argument("--host", default="127.0.0.1", help="interface to listen on")
    srv.add_argument("--replicas", type=int, default=1, help="number of replicas in this process")
    srv.add_argument("--model", default="sim-model", help="served model name (requests for another name get 404)")
    srv.add_argument("--runner", choices=[r.value for r in Runner], default=Runner.BOTH.value,
                     help="what the replica serves, as vLLM's --runner: generate (no /v1/embeddings), pooling "
                          "(/v1/embeddings only), or both (the simulator's own)")
    srv.add_argument("--api-key", default=None,
                     help="as vLLM's --api-key: every /v1/* route needs `Authorization: Bearer KEY` and answers "
                          "401 otherwise; /health /metrics /version /tokenize stay open (default: unset, no key)")
    srv.add_argument("--enable-prompt-tokens-details", action="store_true",
                     help="as vLLM's flag: usage.prompt_tokens_details carries cached_tokens (null without it)")
    srv.add_argument("--enable-responses-store", action="store_true",
                     default=os.environ.get("VLLM_ENABLE_RESPONSES_API_STORE", "") not in ("", "0"),
                     help="store /v1/responses answers in memory, as vLLM with VLLM_ENABLE_RESPONSES_API_STORE=1 "
                          "(that variable set to anything but 0 turns it on too)")
    srv.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio",
                     help="event loop (asyncio keeps step timing closer to the model under load)")
    srv.add_argument("--log-level", default="INFO", help="logging level")

    eng = p.add_argument_group("engine (vLLM v1 scheduler)")
    eng.add_argument("--max-num-seqs", type=int, default=_DEFAULT_ENGINE.max_num_seqs,
                     help="most requests running at once")
    eng.add_argument("--max-num-batched-tokens", type=int, default=_DEFAULT_ENGINE.max_num_batched_tokens,
                     help="token budget of one step; longer prompts are prefilled in chunks")
    eng.add_argument("--num-blocks", type=int, default=_DEFAULT_ENGINE.num_blocks, help="KV-cache blocks")
    eng.add_argument("--block-size", type=int, default=_DEFAULT_ENGINE.block_size, help="tokens per KV block")
    eng.add_argument("--max-model-len", type=int, default=_DEFAULT_ENGINE.max_model_len,
                     help="context length: a longer prompt is refused, max_tokens clamped to what fits beside it")
    eng.add_argument("--scheduling-policy", choices=[s.value for s in SchedulingPolicy], default="fcfs",
                     help="waiting order and preemption victim; priority: LOWER request priority runs first")
    eng.add_argument("--enable-prefix-caching", action="store_true", help="share full prompt blocks by prefix hash")
    eng.add_argument("--kv-offload-blocks", type=int, default=_DEFAULT_ENGINE.offload_blocks,
                     help="blocks of a host-memory tier every full block is copied to as it is produced (vLLM's "
                          "CPU offloading connector): a prefix whose GPU blocks were reused is loaded back from "
                          "there instead of recomputed; 0: no tier; needs --enable-prefix-caching")
    eng.add_argument("--preemption", choices=("recompute", "none"), default="recompute",
                     help="what happens when running sequences outgrow the KV cache: recompute preempts the "
                          "newest (vLLM); none counts an out-of-memory and fails every request of that step's batch")
    eng.add_argument("--default-max-tokens", type=int, default=None,
                     help="output cap of a request that sets none, as a model's generation_config max_new_tokens "
                          "(unset: vLLM's, the rest of the context for chat; completions default to 16)")
    eng.add_argument("--output-length-mode", choices=[m.value for m in OutputLengthMode], default="fixed",
                     help="fixed: exactly max_tokens; random: uniform in [1, max_tokens] unless ignore_eos")

    tim = p.add_argument_group("timing model (milliseconds)")
    tim.add_argument("--step-overhead-ms", type=float, default=_DEFAULT_TIMING.step_overhead_ms,
                     help="fixed cost of every step")
    tim.add_argument("--prefill-ms-per-token", type=float, default=_DEFAULT_TIMING.prefill_ms_per_token,
                     help="cost of each prompt token computed in a step")
    tim.add_argument("--prefill-base-ms", type=float, default=_DEFAULT_TIMING.prefill_base_ms,
                     help="cost of a step that computes any prompt (vLLM on CPU: most of a first token)")
    tim.add_argument("--prefill-ms-per-seq", type=float, default=_DEFAULT_TIMING.prefill_ms_per_seq,
                     help="extra cost per request whose prompt a step computes, whatever its length")
    tim.add_argument("--decode-base-ms", type=float, default=_DEFAULT_TIMING.decode_base_ms,
                     help="cost of a step that decodes at least one sequence")
    tim.add_argument("--decode-ms-per-seq", type=float, default=_DEFAULT_TIMING.decode_ms_per_seq,
                     help="extra cost per decoding sequence in a step")
    tim.add_argument("--load-ms-per-token", type=float, default=_DEFAULT_TIMING.load_ms_per_token,
                     help="cost of each token loaded back from the offload tier in the step that admits it")
    tim.add_argument("--jitter", type=float, default=0.0, help="relative std-dev of gaussian step-time noise")
    tim.add_argument("--zero-latency", action="store_true",
                     help="all costs 0 (for throughput tests of other components)")
    tim.add_argument("--seed", type=int, default=0, help="seed for jitter, random output lengths and faults")
    tim.add_argument("--timer-spin-ms", type=float, default=1.5,
                     help="end of each step waited by yielding, not a timer (accuracy; 0 saves CPU)")

    flt = p.add_argument_group("fault injection (also POST /admin/faults at runtime)")
    flt.add_argument("--fault-429-rate", type=float, default=0.0, help="fraction of requests answered 429")
    flt.add_argument("--fault-500-rate", type=float, default=0.0, help="fraction of requests answered 500")
    flt.add_argument("--fault-503-rate", type=float, default=0.0, help="fraction of requests answered 503")
    flt.add_argument("--fault-delay-ms", type=float, default=0.0, help="delay added before each request")
    flt.add_argument("--admin-key", default=os.environ.get("HOLDBACK_ADMIN_KEY") or None,
                     help="key /admin/faults requires as `Authorization: Bearer KEY` (default: $HOLDBACK_ADMIN_KEY; "
                          "unset: open)")
    return flags_from_env(p, "sim")


def config_from_args(args: argparse.Namespace) -> SimConfig:
    timing = TimingModel.zero() if args.zero_latency else TimingModel(
        step_overhead_ms=args.step_overhead_ms,
        prefill_ms_per_token=args.prefill_ms_per_token,
        decode_base_ms=args.decode_base_ms,
        decode_ms_per_seq=args.decode_ms_per_seq,
        load_ms_per_token=args.load_ms_per_token,
        jitter=args.jitter,
        prefill_base_ms=args.prefill_base_ms,
        prefill_ms_per_seq=args.prefill_ms_per_seq,
    )
    return SimConfig(
        model=args.model,
        engine=EngineConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            num_blocks=args.num_blocks,
            block_size=args.block_size,
            max_model_len=args.max_model_len,
            scheduling_policy=SchedulingPolicy(args.scheduling_policy),
            enable_prefix_caching=args.enable_prefix_caching,
            offload_blocks=args.kv_offload_blocks,
            preemption=args.preemption == "recompute",
        ),
        timing=timing,
        faults=FaultSettings(args.fault_429_rate, args.fault_500_rate, args.fault_503_rate, args.fault_delay_ms),
        default_max_tokens=args.default_max_tokens,
        output_length_mode=OutputLengthMode(args.output_length_mode),
        seed=args.seed,
        timer_spin_ms=args.timer_spin_ms,
        admin_key=args.admin_key,
        api_key=args.api_key,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        runner=Runner(args.runner),
        responses_store=args.enable_responses_store,
    )


async def serve(config: SimConfig, host: str, port: int, replicas: int) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    started: list[SimReplica] = []
    try:
        for i in range(replicas):
            replica = SimReplica(config, index=i)
            await replica.start(host, port + i)
            started.append(replica)
            log_event(log, "replica_started", replica=replica.name, model=config.model, url=f"http://{host}:{port + i}")
        await stop.wait()
    finally:
        for replica in started:
            await replica.stop()
        log_event(log, "stopped", replicas=len(started))


def _new_loop(kind: str) -> asyncio.AbstractEventLoop:
    if kind == "uvloop":
        try:
            import uvloop
        except ImportError:
            raise SystemExit("--loop uvloop: uvloop is not installed; use --loop asyncio") from None
        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_json_logging(None, args.log_level)
    if args.replicas < 1:
        print("holdback sim: --replicas must be at least 1", file=sys.stderr)
        return 2
    try:
        config = config_from_args(args)
        config.validate()
    except ValueError as exc:
        print(f"holdback sim: {exc}", file=sys.stderr)
        return 2
    loop = _new_loop(args.loop)
    try:
        loop.run_until_complete(serve(config, args.host, args.port, args.replicas))
    except OSError as exc:
        print(f"holdback sim: cannot listen on {args.host}:{args.port}..{args.port + args.replicas - 1}: {exc}",
              file=sys.stderr)
        return 1
    finally:
        loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
