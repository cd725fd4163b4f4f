"""The umbrella command `holdback`: the dispatcher (`main`), `holdback up` (`up`, with `instance_lock` and
`listeners`), `demo`, `keys`, `files` and `db`. It is the one part of `holdback` that imports every component:
each subcommand's module is imported only when that subcommand runs.
"""
