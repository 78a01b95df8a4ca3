"""What the scripts, the studies, data-prep and the tests share, installed with the plugin (setup.py):
paths, one way to fail on bad input, atomic writes (common), fairseq's logs (logs),
building models outside fairseq-train (models) and the launchers' arithmetic (launch)."""
