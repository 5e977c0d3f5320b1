"""What lets the daemon stop and start again under live clients, in one place.

- ``persist``: the state as journal records (:func:`~.persist.image_of`), and
  :class:`~.persist.Persistence`, which journals every change and parks every
  chunk with the service manager;
- ``journal``: the journal file, its records framed and checksummed one by one;
- ``journaled``: a journaled session or buffer read back as a type, checked whole;
- ``restore``: a state rebuilt from those records and the chunks' descriptors;
- ``takeover``: the live handover channel between an old daemon and its successor,
  and ``handshake`` the messages it exchanges, each a type checked on the way in;
- ``inherit``: what a starting daemon takes from those before it (a predecessor,
  the service manager's FD store and sockets).
"""
