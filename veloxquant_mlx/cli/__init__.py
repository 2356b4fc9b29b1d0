"""The `veloxquant` command line; see main.py for how subcommands plug in."""
