"""Which of the runner's jobs the options ask for: a listing, a compression, an export, a comparison, several
models, the viewer, or one run. It sits above run.py and several_models.py, which runs run.py's runs."""
from __future__ import annotations

from trajgen import fork_server, help_text, tool_check
from trajgen.options import RunOptions
from trajgen.tools import mcp_config


def main(opts: RunOptions) -> int:
    """The exit status of whatever the options ask for."""
    if opts.list_distributions:
        servers = mcp_config.load_config(opts.mcp_config) if opts.mcp_config else ()
        print(help_text.distributions_text(tuple(s.name for s in servers)))
        return 0
    if opts.list_tools:
        print(tool_check.listing(opts))
        return 0
    if opts.compress:
        from trajgen import compress
        return compress.run(opts)
    if opts.export:
        from trajgen import run
        return run.run_export(opts)
    if opts.rescore:
        from trajgen import rescore
        return rescore.run(opts)
    if opts.compare:
        from trajgen import compare_command  # it and several_models import the viewer's comparison page
        return compare_command.run(opts)
    if opts.models:
        from trajgen import several_models
        return several_models.run(opts)
    if opts.view or opts.report:
        from trajgen.viewer import command as viewer  # the viewer's modules only when asked for
        return viewer.run(opts)
    if opts.executor == "processes" and not opts.dry_run:  # its imports overlap the run's, imported below
        fork_server.start()
    from trajgen import run
    return run.single(opts).status
