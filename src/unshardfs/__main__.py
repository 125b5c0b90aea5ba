import sys

from unshardfs.app.cli import main

sys.exit(main())
