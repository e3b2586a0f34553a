"""First names used for puzzle inhabitants.

No name is a case-insensitive substring of another, so "NAME is a knight" can be
matched in an answer without one name shadowing another.
"""

NAMES: tuple[str, ...] = tuple(
    """
    Zoey Oliver Ethan Sophia Liam Emma Noah Isabella Lucas Logan Amelia Aiden
    Elijah Evelyn James Abigail Benjamin Emily Jacob Elizabeth Michael Sofia Daniel
    Henry Scarlett Jackson Sebastian Owen Samuel Matthew Chloe Joseph Penelope Levi
    Layla David Wyatt Julian Eleanor Luke Hannah Gabriel Lillian Isaac Anthony Dylan
    Lincoln Natalie Asher Christopher Joshua Andrew Theodore Audrey Caleb Ryan Nathan
    Claire Thomas Charles Lucy Isaiah Aaron Caroline Connor Cameron Adrian Robert Maya
    Naomi Dominic Xavier Sarah Allison Gavin Tyler Alice Madelyn Brandon Cora Kevin
    Ezra Jason Hailey Wesley Valentina Zachary Silas Declan Sadie Lydia Jasper Vincent
    Tristan Delilah Graham Marcus Vivian Walter Helen Harold Irene Martha Oscar Felix
    Edith Fiona Rupert Ingrid Greta Yvonne Quentin Ulysses Yara
    """.split()
)
