"""`python -m serveattn demo [...]`: see `python -m serveattn demo --help`."""
import sys

COMMANDS = {"demo": "run a tiny transformer on a paged KV cache, checked against the float64 oracle"}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in COMMANDS:
        print("usage: python -m serveattn <command> [options]\ncommands:")
        for name, text in COMMANDS.items():
            print(f"  {name:8s} {text}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    from . import demo
    return demo.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
