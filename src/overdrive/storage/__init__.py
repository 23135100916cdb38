"""Where runs write: faults on the way, room on the disk, one run per output_dir.

    faults.py   a write meeting ENOSPC, EDQUOT, EROFS, EACCES or EIO: one message (path, file
                system, space needed and free, the key to change); library threads kept quiet
    space.py    a checkpoint's size (estimated, then measured) against the free space
    lock.py     the output_dir lock: flock, released by the kernel when its holder dies
"""
