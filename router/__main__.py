"""``python -m router --decode-addresses HOST:PORT ... --prefill-addresses HOST:PORT ... --model-dir DIR``."""

from __future__ import annotations

import sys

from router.app import serve
from router.config import build_arg_parser, config_from_args
from svc_common.cli_help import HelpFormatter, add_version
from svc_common.model_source import hub_id_of, resolve_model


def main(argv: list[str] | None = None) -> None:
    """Parse the flags once, build the RouterConfig, serve until interrupted."""
    parser = build_arg_parser()
    parser.formatter_class = HelpFormatter
    add_version(parser)
    args = parser.parse_args(argv)
    try:
        if args.model_dir:  # a hub id becomes its cached directory (the services resolve theirs the same way)
            args.served_model_name = args.served_model_name or hub_id_of(args.model_dir) or ""
            args.model_dir = resolve_model(args.model_dir)
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    serve(config)


if __name__ == "__main__":
    main(sys.argv[1:])
