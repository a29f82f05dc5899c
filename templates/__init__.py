"""The batch template, installed as the package `hpcrl.templates` (setup.cfg maps this folder there)."""
