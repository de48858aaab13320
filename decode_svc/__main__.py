"""python -m decode_svc: run one decode service."""

from __future__ import annotations

import sys

from svc_common.service_main import run_service


def main(argv: list[str] | None = None) -> int:
    from decode_svc.config import build_arg_parser, config_from_args
    from decode_svc.server import serve

    return run_service(build_arg_parser(), config_from_args, serve, argv)


if __name__ == "__main__":
    sys.exit(main())
