"""`python -m kvstrata.router [flags]`: run the router."""

import sys

from kvstrata.router.launch import main

if __name__ == "__main__":
    sys.exit(main())
