"""The live room: real-time transcription sessions, independent of any wire protocol.

- ``vad_stream``: ``VadStreams``, one per server: every open session's 16 kHz audio goes through the Silero VAD
  network (``glmasr.audio.vad``) incrementally, window by window (32 ms), all sessions' pending windows as one
  batch per window step on a worker thread, probabilities handed back to each stream's callback in the event loop.
- ``turns``: ``TurnSettings`` and ``TurnDetector``: OpenAI ``server_vad``-style turn detection (threshold,
  prefix padding, silence duration, idle timeout, a maximum turn length cut at a pause), pure logic on the
  probabilities, positions in 16 kHz samples since the session started.
- ``session``: ``LiveSession``: raw audio in (decoded by ``glmasr.audio.stream.StreamDecoder``), turns committed
  by the detector or the client, each committed turn transcribed as one engine request whose tokens stream out;
  optional partials (drafts agreed by LocalAgreement-2) that the final continues from; ``events`` are what it emits.

The OpenAI Realtime endpoint (``glmasr.server.realtime``) maps these to its JSON events.
"""
