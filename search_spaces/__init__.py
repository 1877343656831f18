"""Search spaces shipped with pdl-tune (YAML package data); `tuner.space` reads them."""
