"""The analysis notebook (analysis.ipynb, paired with analysis.py by jupytext), installed as tuner.notebooks: what
`tune notebook` copies out of an installed pdl-tune."""
