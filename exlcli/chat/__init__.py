"""`exlcli chat`: an interactive terminal chat over any EngineClient.

app.py (the loop), commands.py (slash commands), session.py (conversation + context window),
settings.py (/set), generate.py (streams in flight), render.py (live Markdown, stats line),
io.py (prompt-toolkit input, Rich consoles), persist.py (/save, /load), launch.py (options -> chat).
"""
