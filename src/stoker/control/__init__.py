"""Control: the behaviour of stoker. It talks only to ports (Store, Runtime, Elector, Clock)."""
