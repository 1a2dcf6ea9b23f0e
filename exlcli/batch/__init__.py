"""`exlcli batch`: run a JSONL file of prompts through the engine, durably and resumably.

lines.py reads input lines into jobs (or bad-line records), output.py writes and reads back result
lines, runner.py keeps a bounded number of requests in flight, progress.py shows how far it got.
failures.py tells a line's failure (an error line) from the file's (stop, print how to resume);
lock.py keeps a second process off an output file.
"""
