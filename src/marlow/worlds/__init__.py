"""Tools of the tiny worlds: the quickstart comparison that runs on one (``quickstart``), the
greedy evaluation of a world (``tinyeval``), and the check that a shipped world is what its
recipe makes (``verify``). The worlds themselves are built in ``marlow.tiny``."""
