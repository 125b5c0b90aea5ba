"""The application: the CLI, its options, opening a SOURCE, the daemon, serve and cluster runs."""
