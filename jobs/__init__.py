"""The example job specs, installed as the package `hpcrl.jobs` (setup.cfg maps this folder there):
`hpcrl init` lists them, `hpcrl init NAME` prints one."""
