"""Shared code of the q3vl post-processing tools (tools/plot_metrics, summarize, ckpt_info, export_hf)."""


class ToolError(Exception):
    """Bad input: the tool prints the message and exits with status 1."""


def run_main(main):
    """Runs main(); a ToolError becomes 'tool: error: message' on stderr and exit status 1."""
    import os
    import sys
    try:
        sys.exit(main())
    except ToolError as e:
        print(f"{os.path.basename(sys.argv[0])}: error: {e}", file=sys.stderr)
        sys.exit(1)
    except BrokenPipeError:  # output piped into head: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
