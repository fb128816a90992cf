"""`hfmeg plan`: a memory and step-time model of one training step, checked against measurements.

hardware.py (GPU kinds, clusters) -> activations.py + memory.py (bytes per GPU) ->
profile.py + step_time.py (seconds per step, from a calibrated profile; flops.py counts the
model FLOPs, with the MFU the trainer logs) ->
search.py (every layout that fits, ranked; `best_layout`) -> cli.py (`python -m hfmeg.plan`,
`hfmeg plan`), with scaling.py (overlapped vs distributed optimizer at scale) and
published.py (predicted vs Megatron-LM's published table), and auto.py (the hardware a
training job runs on and the lines it prints for the trainer's `--layout auto`). measure.py and
calibrate.py run real steps and kernels to check and feed the model
(tools/check_plan.py). MoE models are planned with their expert parallelism (EP): experts per
rank, expert-DP sharding, the all-to-alls.
"""
