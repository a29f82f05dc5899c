"""Synthetic tasks that ship with hpcrl: a prompt generator and a rule reward each."""
