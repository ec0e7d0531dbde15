"""`python -m clusterpulse.trainer` (what torchrun starts in each rank): its flags are
checked before torch is imported. --help and a bad flag answered after 2-3 s of CPU per
rank, torch's import; the launcher (clusterpulse-train) already checks them without it.
main() parses them again (a few milliseconds) and reports everything after the flags."""

import sys

from clusterpulse.trainer.config import ConfigError, parse_config

try:
    parse_config(sys.argv[1:])
except ConfigError as err:
    print(f"trainer: error: {err}", file=sys.stderr)
    raise SystemExit(2) from None

from clusterpulse.trainer.main import main  # torch, once the flags are good

raise SystemExit(main())
