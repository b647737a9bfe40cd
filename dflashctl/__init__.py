"""dflashctl: deploy, run and debug DFlash drafter training on Proxmox GPU hosts."""

__version__ = "0.1.0"
