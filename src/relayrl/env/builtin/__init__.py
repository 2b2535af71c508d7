"""Environments that ship with relayrl (``env.factory: <name>``)."""
