"""What the daemon does on the node's file system: the interposer and its ELF check,
per-container cache directories, tombstones and the reaper, disk use, CDI spec files,
the unit-size guard."""
