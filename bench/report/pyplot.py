"""matplotlib's pyplot on its file-only backend, for every report's plots; a clear exit when it is missing."""

from __future__ import annotations


def pyplot():  # noqa: ANN201 (matplotlib.pyplot, imported only here)
    try:
        import matplotlib
    except ImportError as exc:
        raise SystemExit("holdback bench: plotting needs matplotlib; install it with `pip install 'holdback[bench]'` "
                         "(`make test` and `make up` install it already)") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt
