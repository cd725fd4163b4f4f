"""The gateway fleet bench (issue 46's Goals): relays on three hosts, two flow controls with the lease in a Redis
of the fleet's own, two simulated replicas and HAProxy in front (bench/lib/fleet.py), measured in one run.

1. Relays scale out. Each round streams realtime clients for --seconds through all three relays (HAProxy) and a
   third as many through one relay (its own address; each relay carries the same load), in alternating order,
   then nothing for as long (the idle arm), counting the CPU seconds the relays and the leader spent.
   Figures: streamed tokens per relay CPU-second with 3 relays ÷ with 1 (goal >= 0.9), the leader's CPU per
   request ÷ a relay's (goal <= 10%), and from that how many relays one leader can serve before its core is full
   (a relay's CPU per request ÷ the leader's).
2. The channel's cost. Each round streams a few realtime clients through a relay on another host (its decisions
   come over the TCP channel from the leader) and through the whole gateway as one process on that host, in
   alternating order. Figure: the median over rounds of TTFT p50 via the relay ÷ via the one process (goal <= 1.05,
   or at most +1 ms).
3. The issue's load: --rows batch rows and --clients realtime streaming clients through HAProxy, nothing struck:
   realtime failed, rows lost and duplicated, and every eviction's decision -> upstream closed (the leader's
   `eviction_confirmed`: decided at the leader, closed at a relay, told over the channel), p99 with its interval
   (goal <= 10 ms).
4. Takeover, last: --kills times kill -9 the leader under load (the killed one started again): leader lost ->
   first new dispatch (the new leader's takeover_done) p99 over the kills (goal <= 2 s), streams cut (goal 0).

    python -m bench.fleet --rows 5000 --clients 50 --kills 10 --out fleet.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.lib.fleet import Fleet, FleetSpec, haproxy_unavailable
from bench.lib.fleet_bench import full_run, scale_arm, takeover, ttft_arm
from bench.lib.fleet_drills import Load
from bench.stats import Estimate, bootstrap_median, bootstrap_percentile, percentile, verdict

FLOWS = ["flow-1", "flow-2"]
PHASES = ("scale", "channel", "load", "takeover")


def _median_estimate(values: list[float]) -> Estimate:
    """The median of per-round figures with its bootstrap interval (rounds resampled)."""
    return bootstrap_median(values) if values else Estimate(None)


def _figure(est: Estimate, goal: float, at_least: bool, unit: str = "") -> dict:
    return {**est.as_dict(), "goal": f"{'>=' if at_least else '<='} {goal:g}{unit}",
            "verdict": verdict(est, goal, at_least)}


def scale_figures(rounds: list[dict]) -> dict:
    """rounds: each {"one": scale_arm record, "three": ..., "idle": the same with no clients (all three relays)}.
    Raw figures count every CPU-second; marginal ones first take off what the processes spend idle over as long
    (heartbeats, the leader's metrics scrapes), the cost that does not grow with requests."""
    ratios: dict[str, list[float]] = {"raw": [], "marginal": []}
    shares: dict[str, list[float]] = {"raw": [], "marginal": []}
    for r in rounds:
        one, three, idle = r["one"], r["three"], r.get("idle")
        for kind in ("raw", "marginal"):
            if kind == "marginal" and not idle:
                continue
            cpu = {}
            for arm in (one, three):
                relay_idle = leader_idle = 0.0
                if kind == "marginal":
                    per_second = arm["seconds"] / idle["seconds"]
                    relay_idle = idle["relay_cpu"] * per_second * arm["relays"] / idle["relays"]
                    leader_idle = idle["leader_cpu"] * per_second
                cpu[arm["relays"]] = (max(1e-9, arm["relay_cpu"] - relay_idle), max(0.0, arm["leader_cpu"] - leader_idle))
            if one["tokens"] and three["tokens"]:
                ratios[kind].append((three["tokens"] / cpu[3][0]) / (one["tokens"] / cpu[1][0]))
            if three["done"]:
                # CPU per request: the leader decides every request, each request passes one relay.
                shares[kind].append(cpu[3][1] / cpu[3][0])
    out: dict = {}
    for kind in ("raw", "marginal"):
        share = _median_estimate(shares[kind])
        out[kind] = {"tokens_per_relay_cpu_3_over_1": _figure(_median_estimate(ratios[kind]), 0.9, True),
                     "leader_cpu_per_request_over_relay": _figure(share, 0.10, False),
                     "relays_one_leader_serves": None if not share.value else round(1 / share.value, 1)}
    per_token = [(r[arm]["tokens"] / r[arm]["relay_cpu"]) for r in rounds for arm in ("one", "three")
                 if r[arm]["relay_cpu"] > 0]
    out["tokens_per_relay_cpu_second"] = round(statistics.median(per_token)) if per_token else None
    return out


def channel_figures(rounds: list[dict]) -> dict:
    """rounds: each {"relay": ttft_arm record, "single": ttft_arm record}."""
    ratios, added_ms = [], []
    for r in rounds:
        relay, single = percentile(r["relay"]["ttft_s"], 0.5), percentile(r["single"]["ttft_s"], 0.5)
        if relay is not None and single:
            ratios.append(relay / single)
            added_ms.append((relay - single) * 1000)
    ratio = _figure(_median_estimate(ratios), 1.05, False)
    added = _figure(_median_estimate(added_ms), 1.0, False, " ms")
    # The goal is either bound: met when one of them is met.
    either = "met" if "met" in (ratio["verdict"], added["verdict"]) else f"{ratio['verdict']} / {added['verdict']}"
    return {"ttft_p50_relay_over_single": ratio, "ttft_p50_added_ms": added, "verdict": either,
            "failed": sum(r[arm]["failed"] for r in rounds for arm in ("relay", "single"))}


def load_figures(run: dict) -> dict:
    closed = run["eviction_closed_s"]
    p99 = bootstrap_percentile([c * 1000 for c in closed], 0.99)
    return {"eviction_closed_p99_ms": _figure(p99, 10.0, False, " ms"), "evictions": len(closed),
            **{k: run[k] for k in ("realtime_requests", "realtime_failed", "rows", "rows_lost", "rows_duplicated",
                                   "running_over_slots", "seconds")}}


def takeover_figures(kills: list[dict]) -> dict:
    first = [k["first_dispatch_after"] for k in kills]
    during = [t for k in kills for t in k["during_ttft_s"]]
    return {"first_dispatch_p99_s": _figure(bootstrap_percentile(first, 0.99), 2.0, False, " s"),
            "first_dispatch_max_s": max(first) if first else None,
            "led_after_max_s": max((k["led_after"] for k in kills), default=None),
            "kills": len(kills), "streams_running_at_kills": sum(k["running_at_kill"] for k in kills),
            "streams_cut": sum(k["cut"] for k in kills),
            "during_takeover_ttft_p99_s": percentile(during, 0.99),
            "rows_lost": sum(k["rows_lost"] for k in kills), "rows_duplicated": sum(k["rows_duplicated"] for k in kills),
            "realtime_failed": sum(k["realtime_failed"] for k in kills)}


def summarize(results: dict) -> dict:
    """The figures of whatever phases `results` holds (main's records)."""
    out: dict = {k: results[k] for k in ("hosts", "commit", "takeover_commit", "command") if k in results}
    if results.get("scale"):
        out["scale"] = scale_figures(results["scale"])
    if results.get("channel"):
        out["channel"] = channel_figures(results["channel"])
    if results.get("load"):
        out["load"] = load_figures(results["load"])
    if results.get("takeover"):
        out["takeover"] = takeover_figures(results["takeover"])
    return out


def _fmt(fig: dict, scale: float = 1.0, digits: int = 3) -> str:
    if fig["value"] is None:
        return f"not measured (goal {fig['goal']})"
    interval = ("" if fig["lo"] is None else
                f" [{fig['lo'] * scale:.{digits}f}, {fig['hi'] * scale:.{digits}f}]")
    return f"{fig['value'] * scale:.{digits}f}{interval} (goal {fig['goal']}: {fig['verdict']})"


def table(summary: dict) -> str:
    """The summary as the lines docs/benchmarks.md quotes."""
    lines = [f"hosts: {summary.get('hosts', '?')}; commit {summary.get('commit', '?')}"]
    if s := summary.get("scale"):
        for kind in ("raw", "marginal"):
            if (f := s.get(kind)) and f["tokens_per_relay_cpu_3_over_1"]["value"] is not None:
                lines += [f"{kind}: tokens per relay CPU-second, 3 relays ÷ 1: {_fmt(f['tokens_per_relay_cpu_3_over_1'])}",
                          f"{kind}: leader CPU per request ÷ a relay's: {_fmt(f['leader_cpu_per_request_over_relay'])}",
                          f"{kind}: relays one leader serves before its core is full: {f['relays_one_leader_serves']}"]
        lines.append(f"tokens per relay CPU-second (median over arms): {s['tokens_per_relay_cpu_second']}")
    if c := summary.get("channel"):
        lines += [f"TTFT p50 via a relay ÷ one process: {_fmt(c['ttft_p50_relay_over_single'])}",
                  f"TTFT p50 added by the relay's channel (ms): {_fmt(c['ttft_p50_added_ms'], digits=2)}",
                  f"the channel's goal (either bound): {c['verdict']}; failed requests {c['failed']}"]
    if ld := summary.get("load"):
        lines += [f"load: {ld['rows']} rows, lost {ld['rows_lost']}, duplicated {ld['rows_duplicated']}; "
                  f"realtime {ld['realtime_requests']} requests, failed {ld['realtime_failed']}; "
                  f"running over slots {ld['running_over_slots']} samples; {ld['seconds']} s",
                  f"eviction decision -> upstream closed p99 (ms), {ld['evictions']} evictions: "
                  f"{_fmt(ld['eviction_closed_p99_ms'], digits=2)}"]
    if t := summary.get("takeover"):
        lines += [f"takeover over {t['kills']} kills (commit {summary.get('takeover_commit', '?')}): leader lost -> "
                  f"first new dispatch p99 (s) {_fmt(t['first_dispatch_p99_s'], digits=2)}, max "
                  f"{t['first_dispatch_max_s']}; standby led within {t['led_after_max_s']} s",
                  f"streams cut {t['streams_cut']} of {t['streams_running_at_kills']} running at the kills; "
                  f"rows lost {t['rows_lost']}, duplicated {t['rows_duplicated']}; realtime failed "
                  f"{t['realtime_failed']}; TTFT p99 of requests sent during a takeover "
                  f"{t['during_takeover_ttft_p99_s']} s"]
    return "\n".join(lines)


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, timeout=30).stdout.strip()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phases", default=",".join(PHASES), help="a subset of %(default)s, run in that order")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the scale and channel phases")
    p.add_argument("--seconds", type=float, default=15, help="each arm's streaming time in a round")
    p.add_argument("--clients", type=int, default=50, help="realtime streaming clients (scale and load phases)")
    p.add_argument("--same-total", action="store_true", help="scale phase: send one relay all --clients (default: "
                   "a third of them, so that each relay carries the same load in both arms)")
    p.add_argument("--ttft-clients", type=int, default=4, help="realtime clients of the channel phase")
    p.add_argument("--tokens", type=int, default=30, help="each realtime stream's tokens")
    p.add_argument("--rows", type=int, default=5000, help="batch rows of the load phase")
    p.add_argument("--senders", type=int, default=32, help="worker-like senders of the batch rows (more than the "
                   "slots the realtime clients leave, so that realtime arrivals evict batch)")
    p.add_argument("--kills", type=int, default=10, help="leader kills of the takeover phase")
    p.add_argument("--kill-rows", type=int, default=300, help="batch rows under each kill")
    p.add_argument("--slots", type=int, default=32, help="slots the gateway is told each replica has (the drills "
                   "use 8; the issue's 50 clients want more)")
    p.add_argument("--commit", default=None, help="run the fleet's processes from this commit (`git archive` into "
                   "a temporary directory), not from the checkout with whatever is uncommitted in it")
    p.add_argument("--out", type=Path, default=None, help="write the records and figures here (JSON)")
    p.add_argument("--log-dir", type=Path, default=None, help="the fleet's logs (default: a temporary directory)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = [p for p in phases if p not in PHASES]
    if unknown:
        _parser().error(f"--phases: unknown {', '.join(unknown)}; choose from {', '.join(PHASES)}")
    for flag, value in (("--rounds", args.rounds), ("--slots", args.slots), ("--clients", args.clients), ("--kills", args.kills),
                        ("--rows", args.rows), ("--ttft-clients", args.ttft_clients), ("--senders", args.senders)):
        if value < 1:
            _parser().error(f"{flag} must be at least 1 (got {value})")
    why = haproxy_unavailable()
    if why:
        print(f"the fleet bench needs HAProxy: {why}", file=sys.stderr)
        return 2
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bench-fleet-"))
    results: dict = {"command": "python -m bench.fleet " + " ".join(argv if argv is not None else sys.argv[1:])}
    tree, rev = None, "HEAD"
    if args.commit:
        commit = _git("rev-parse", "--short", args.commit)
        if not commit:
            _parser().error(f"--commit {args.commit}: git knows no such commit here")
        tree = Path(tempfile.mkdtemp(prefix=f"bench-fleet-{commit}-"))
        archive = subprocess.run(["git", "archive", commit], capture_output=True, check=True, timeout=120).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True, timeout=120)
        results["commit"], rev = commit, commit  # HEAD may move while the bench runs
    else:
        dirty = " with uncommitted changes" if _git("status", "--porcelain", "--untracked-files=no") else ""
        results["commit"] = _git("rev-parse", "--short", "HEAD") + dirty
    with Fleet(FleetSpec(slots=args.slots, tree=tree), log_dir) as fleet:
        results["hosts"] = fleet.describe()
        print(f"fleet: {results['hosts']}; logs in {log_dir}", flush=True)
        relays = list(fleet.relay_urls)
        for phase in phases:
            began = time.monotonic()
            if phase == "scale":
                results["scale"] = []
                for r in range(args.rounds):
                    # Each relay carries the same load in both arms (a third of the clients through one), unless
                    # --same-total: then one relay carries what three share.
                    one = args.clients if args.same_total else max(1, round(args.clients / len(relays)))
                    arms = [("one", relays[:1], one), ("three", relays, args.clients), ("idle", relays, 0)]
                    record = {name: scale_arm(fleet, chosen, clients, args.tokens, args.seconds)
                              for name, chosen, clients in (arms if r % 2 == 0 else arms[1::-1] + arms[2:])}
                    results["scale"].append(record)
                    print(json.dumps({"scale_round": r, **record}), flush=True)
            elif phase == "channel":
                single = fleet.start_gateway(relays[0])
                results["channel"] = []
                for r in range(args.rounds):
                    arms = [("relay", fleet.relay_urls[relays[0]]), ("single", single)]
                    record = {name: ttft_arm(url, args.ttft_clients, args.tokens, args.seconds)
                              for name, url in (arms if r % 2 == 0 else arms[::-1])}
                    results["channel"].append(record)
                    print(json.dumps({"channel_round": r, **{k: {"p50_s": percentile(v["ttft_s"], 0.5),
                                                                  "failed": v["failed"]}
                                                              for k, v in record.items()}}), flush=True)
            elif phase == "load":
                fleet.settle()
                results["load"] = full_run(fleet, Load(clients=args.clients, tokens=args.tokens, rows=args.rows,
                                                       senders=args.senders, strike_after=0.5, deadline=1800), FLOWS)
                print(json.dumps({k: v for k, v in results["load"].items() if k != "eviction_closed_s"}), flush=True)
            else:
                results["takeover_commit"] = _git("log", "-1", "--format=%h %s", rev, "--",
                                                  "gateway/relays/takeover.py", "gateway/relays/leadership.py")[:120]
                results["takeover"] = []
                for k in range(args.kills):
                    record = takeover(fleet, Load(clients=args.clients, tokens=args.tokens, rows=args.kill_rows,
                                                  senders=args.senders, strike_after=0.25))
                    results["takeover"].append(record)
                    print(json.dumps({"kill": k, **{n: v for n, v in record.items() if n != "during_ttft_s"}}),
                          flush=True)
            print(f"phase {phase}: {time.monotonic() - began:.0f} s", flush=True)
    summary = summarize(results)
    print(table(summary))
    if args.out:
        args.out.write_text(json.dumps({"records": results, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
