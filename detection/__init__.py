"""Straggler scoring shared by the trainer's in-band consensus and offline replay.

`detection.scoring` imports only numpy (no torch), so the same code scores a live job
every few steps and a recorded trace after the fact (`clusterpulse-detect replay`).
"""
