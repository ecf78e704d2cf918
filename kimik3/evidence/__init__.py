"""Design and evidence at a glance (docs/architecture.md §13): the units a reviewer judges, derived from the code
(``units``), what covers each and what it last showed (``coverage``, ``results``), one dossier per unit and the page
of all of them (``dossier``, ``page``), and a bounded review of a change (``review``)."""
