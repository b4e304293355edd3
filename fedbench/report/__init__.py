"""Run records -> tables, figures and the scoreboard, generic over papers: what each paper adds (row keys, labels,
plot kinds, studies) is registered in ``registry`` by fedbench.papers (loaded by ``tables``)."""
