import sys

from weightsync.cli import main

sys.exit(main())
