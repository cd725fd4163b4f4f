"""What counting shared prompt prefixes costs flow control: the KV ledger's reserve and release of one request,
with its prefix against without one, in the same process and round.

Flow control reserves at every dispatch and releases at every end, in the one process that decides for every relay.
Cases: a prompt of 8 and of 64 prefix blocks (128 characters each: the shortest counted and the longest hashed)
that nothing else on the replica shares, and one of 31 blocks that 7 running requests share (a 1,000-token system
prompt). Each round times every case (`timeit`, the best of 5 repeats of `--number` pairs) in a shuffled order; the
figure per case is the median over rounds of its time ÷ the same round's time without a prefix, with a bootstrap
interval, and the added microseconds per request on this machine beside it.

    .venv/bin/python -m bench.micro.shared_prefix_cost --rounds 7
"""

from __future__ import annotations

import argparse
import random
import statistics
import timeit
from typing import Callable

from bench.stats import bootstrap_median
from gateway.flow.ledger import KvLedger

CASES = {"no prefix": (0, 0), "8 blocks, not shared": (8, 0), "64 blocks, not shared": (64, 0),
         "31 blocks, shared by 7 running": (31, 7)}


def pair(blocks: int, sharing: int) -> Callable[[], None]:
    """One reserve and release on a ledger where `sharing` requests already hold the same `blocks`-block prefix."""
    ledger = KvLedger(block_tokens=16, safety_factor=1.0, window=60)
    prefix = tuple(range(blocks))
    kw = {"prefix": prefix, "prefix_tokens": blocks * 32}
    for i in range(sharing):
        ledger.reserve(request_id=f"held-{i}", fairness_id="t", traffic_class="batch", priority=-10, replica="r",
                       prompt_tokens=1200, max_new_tokens=16, now=0.0, **kw)

    def one() -> None:
        res = ledger.reserve(request_id="x", fairness_id="t", traffic_class="batch", priority=-10, replica="r",
                             prompt_tokens=1200, max_new_tokens=16, now=0.0, **(kw if blocks else {}))
        ledger.release(res, 1.0)
    return one


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.micro.shared_prefix_cost", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--rounds", type=int, default=7, help="rounds, each timing every case (default %(default)s)")
    p.add_argument("--number", type=int, default=5000, help="reserve-release pairs per timing (default %(default)s)")
    args = p.parse_args(argv)
    for name in ("rounds", "number"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    rnd = random.Random(0)
    times: dict[str, list[float]] = {case: [] for case in CASES}
    for _ in range(args.rounds):
        order = list(CASES)
        rnd.shuffle(order)
        for case in order:
            one = pair(*CASES[case])
            times[case].append(min(timeit.repeat(one, number=args.number, repeat=5)) / args.number)
    out = {}
    print(f"reserve + release of one request, {args.rounds} rounds: ÷ no prefix in the same round (median [95%]), "
          "and the added µs on this machine")
    for case in CASES:
        ratios = [t / base for t, base in zip(times[case], times["no prefix"])]
        est = bootstrap_median(ratios)
        added = statistics.median(t - base for t, base in zip(times[case], times["no prefix"])) * 1e6
        out[case] = {"ratio": est.value, "lo": est.lo, "hi": est.hi, "added_us": added,
                     "us": statistics.median(times[case]) * 1e6}
        print(f"  {case}: {est.value:.2f} [{est.lo:.2f}, {est.hi:.2f}], +{added:.1f} µs "
              f"({out[case]['us']:.1f} µs a pair)")
    return out


if __name__ == "__main__":
    main()
