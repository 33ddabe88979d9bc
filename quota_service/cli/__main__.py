"""`python -m quota_service.cli`: the `kvquota` command, where it is not installed as a script."""

import sys

from quota_service.cli.parser import main

sys.exit(main())
