"""`python -m holdback.cli COMMAND ...`: how `holdback up`, the tests and the docs start every child."""

import sys

from holdback.cli.main import main

sys.exit(main())
