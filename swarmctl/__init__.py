"""swarmctl: the command-line client of swarmd. Thin: parse, call the daemon, render."""
