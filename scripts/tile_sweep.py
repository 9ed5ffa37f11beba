"""One loop for the probes' --tiles option: run a probe once per tile configuration, in one process."""
import os


def sweep(env_name: str, tiles_arg: str, probe) -> None:
    """Sets `env_name` to each ';'-separated configuration of `tiles_arg` (none: the table's) and calls probe();
    a configuration that fails (one that does not fit shared memory, say) is reported in a line and skipped."""
    for tiles in tiles_arg.split(";") if tiles_arg else [None]:
        if tiles:
            os.environ[env_name] = tiles
        try:
            probe()
        except Exception as e:
            print(f"tiles {tiles}: {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
