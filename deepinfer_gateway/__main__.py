"""`python -m deepinfer_gateway`: the `deepinfer-gateway` console script (process/cli.py)."""

from deepinfer_gateway.process.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
