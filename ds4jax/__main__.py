import sys

from ds4jax.cli import main

sys.exit(main())
