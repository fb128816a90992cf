"""`hfmeg plan`: a memory and step-time model of one training step, checked against measurements.

hardware.py (GPU kinds, clusters) -> activations.py + memory.py (bytes per GPU) ->
profile.py + step_time.py (seconds per step, from a calibrated profile) ->
search.py (every layout that fits, ranked) -> cli.py (`python -m hfmeg.plan`).
measure.py and calibrate.py run real steps and kernels to check and feed the model.
"""
