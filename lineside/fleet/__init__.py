"""A fleet of serving nodes behind one gateway: the fleet file, rolling pushes, the gateway, status.

Imports run one way: this package uses lineside.jetson (planner, push) and lineside.bundle; nothing in
the runtime or the server imports it.
"""
