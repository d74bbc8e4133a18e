"""What every layer uses: command-line helpers, logging, build information, inotify."""
