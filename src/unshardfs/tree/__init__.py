"""The node API: the directories and files every format produces and every front end serves."""
