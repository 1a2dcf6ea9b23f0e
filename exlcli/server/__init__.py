"""`exlcli serve`: an OpenAI-shaped HTTP API over one EngineClient, its live display, and the
RemoteClient that chat / batch / bench use to attach to a running server."""
