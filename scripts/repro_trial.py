"""Re-run one trial of a run folder on the GPU, alone in this process: its configuration as the study measured it
(repaired), optionally edited, checked against the fp32 reference and timed as the tuner times it.

usage: python3 scripts/repro_trial.py RUN_FOLDER TRIAL_NUMBER [kernel.field=value ...]
For a trial that crashed or came out incorrect: does it again, and does it with one field changed?
"""

import sys

import pandas as pd
import torch

from tuner.device import DeviceInfo
from tuner.layer import DecoderStack, check_config, random_stack_weights, repair_config, stack_depth
from tuner.space import to_config
from tuner.timing import time_replay


def main():
    folder, number, edits = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    import json

    best = json.load(open(f"{folder}/best.json"))
    from tuner.shapes import resolve

    shape = resolve(best["shape"]["name"])
    row = pd.read_csv(f"{folder}/trials.csv").set_index("number").loc[number]
    params = {k: (float(v) if k.endswith("_ratio") else int(v)) for k, v in row.items() if "." in k and v == v}
    dev = DeviceInfo.from_torch()
    cfg = repair_config(to_config(params), shape, 2, dev).edited(edits)
    print(f"{folder} trial {number} ({row['status']}: {row.get('reason', '')}) {' '.join(edits)}")
    for k, c in cfg.kernels():
        print(f"  {k}: {c}")
    bad = check_config(cfg, shape, 2, dev)
    if bad:
        print(f"invalid: {bad}")
        return
    n = stack_depth(shape, 2, dev.l2_bytes)
    st = DecoderStack(shape, cfg, n_layers=n, dtype=torch.float16,
                      weights=random_stack_weights(shape, n, torch.float16, "cuda", 0))
    st.capture()
    errs = [st.check(seed) for seed in range(5)]
    t = time_replay(st.replay, n, reps=30, warmup=5)
    print(f"rel. errors {[f'{e:.2g}' for e in errs]}; {t.median_us:.2f} us/layer")


if __name__ == "__main__":
    from tuner.device import require_gpu

    require_gpu(__file__)
    main()
