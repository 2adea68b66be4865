"""Sans-I/O wire protocol: frames, tensor codec, typed messages and their validation.

Nothing in this package imports asyncio, websockets or transformers (a test checks it). It turns
bytes into typed messages and back; the transport moves the bytes. Import from its modules
(:mod:`.frames`, :mod:`.codec`, :mod:`.messages`, :mod:`.state`, :mod:`.fed`); this package module imports
nothing, so that :mod:`.choices` loads without torch (the command line's parser reads it).
"""
