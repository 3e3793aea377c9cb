package pgtest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
)

// baseBackup copies src's data directory into dst as a base backup for a
// standby that streams from src through the physical slot slot (created
// here if missing). It is the low-level backup of the PostgreSQL manual
// ("Making a Base Backup Using the Low Level API"), done with a file copy
// because every node of a cluster is on this machine: pg_backup_start on
// one session, copy, pg_backup_stop on the same session, and its label
// file written as backup_label. It replaces pg_basebackup, which the
// zonky builds of PostgreSQL 16 and later do not ship, and is the one way
// replicas are made on every version, 15 included.
//
// What makes the copy safe while src keeps writing: pages copied torn or
// stale are overwritten during replay, because a running backup forces
// full-page writes (whatever full_page_writes says, and the harness turns
// it off) and replay starts at the checkpoint pg_backup_start made; the
// standby is consistent only once it has replayed up to the backup-end
// record that pg_backup_stop writes. The WAL in between is not copied: the
// standby streams it from src, which keeps it for the slot, created
// before the backup starts.
func baseBackup(ctx context.Context, src *Node, dst, slot string) error {
	if err := src.ensureSlot(ctx, slot); err != nil {
		return err
	}
	conn, err := src.connect(ctx, "")
	if err != nil {
		return err
	}
	// Closing the session ends a backup that has not stopped, so an error
	// below leaves nothing running on src.
	defer func() { _ = conn.Close(context.Background()) }()
	if _, err := conn.Exec(ctx, "SELECT pg_backup_start($1, fast => true)", "pgtest "+slot); err != nil {
		return fmt.Errorf("pgtest: base backup of %s: %w", src.name, err)
	}
	if err := copyDataDir(src.dataDir, dst); err != nil {
		return fmt.Errorf("pgtest: base backup of %s into %s: %w", src.name, dst, err)
	}
	var label, spcmap string
	err = conn.QueryRow(ctx, "SELECT labelfile, spcmapfile FROM pg_backup_stop(wait_for_archive => false)").Scan(&label, &spcmap)
	if err != nil {
		return fmt.Errorf("pgtest: base backup of %s: %w", src.name, err)
	}
	if spcmap != "" {
		return fmt.Errorf("pgtest: base backup of %s: tablespaces are not supported (tablespace_map %q)", src.name, spcmap)
	}
	if err := writeServiceFile(filepath.Join(dst, "backup_label"), []byte(label)); err != nil {
		return fmt.Errorf("pgtest: %w", err)
	}
	return nil
}

// Directories whose contents a base backup leaves out, as pg_basebackup
// does (src/backend/backup/basebackup.c): runtime state the server
// rebuilds or that belongs to the source alone. The directories themselves
// are kept, since the server expects them. pg_wal keeps its
// subdirectories and timeline history files, which a standby of a
// promoted node needs; the segments stream from the source.
var skipContents = map[string]bool{
	"pg_dynshmem":  true,
	"pg_notify":    true,
	"pg_replslot":  true,
	"pg_serial":    true,
	"pg_snapshots": true,
	"pg_stat_tmp":  true,
	"pg_subtrans":  true,
	"pg_wal":       true,
}

// Files in the top directory a base backup leaves out: the source's lock
// and options, labels and signals of its own, and logs. pg_control is
// copied last, by copyControlFile.
var skipFiles = map[string]bool{
	"postmaster.pid":           true,
	"postmaster.opts":          true,
	"backup_label":             true,
	"backup_label.old":         true,
	"tablespace_map":           true,
	"tablespace_map.old":       true,
	"backup_manifest":          true,
	"current_logfiles":         true,
	"postgresql.auto.conf.tmp": true,
	"standby.signal":           true,
	"recovery.signal":          true,
	"global/pg_control":        true,
}

// skip says whether a base backup leaves out rel, a path relative to the
// data directory.
func skip(rel string, isDir bool) bool {
	name, parent := filepath.Base(rel), filepath.Dir(rel)
	switch {
	case skipFiles[rel]:
		return true
	case skipContents[parent]:
		return !(parent == "pg_wal" && (isDir || strings.HasSuffix(name, ".history")))
	case strings.HasPrefix(filepath.Base(parent), "pgsql_tmp"):
		return true // temporary files, in base/pgsql_tmp and the like
	case isDir:
		return false
	}
	// Relation cache files, rebuilt at startup; temporary files; a relation
	// map being replaced (16 and later).
	return strings.HasPrefix(name, "pg_internal.init") || strings.HasPrefix(name, "pgsql_tmp") || name == "pg_filenode.map.tmp"
}

// copyDataDir copies a running server's data directory src to dst (which
// must not exist), owned by the service user. Files that vanish while it
// walks (a dropped table, a removed temporary file) are skipped and files
// that shrink are copied short, as pg_basebackup does; replay sorts both
// out.
func copyDataDir(src, dst string) error {
	err := filepath.WalkDir(src, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) && path != src {
				return nil
			}
			return err
		}
		rel, err := filepath.Rel(src, path)
		if err != nil {
			return err
		}
		if rel == "." {
			return mkdirService(dst)
		}
		if skip(rel, d.IsDir()) {
			if d.IsDir() {
				return filepath.SkipDir
			}
			return nil
		}
		out := filepath.Join(dst, rel)
		switch {
		case d.IsDir():
			if err := mkdirService(out); err != nil {
				return err
			}
			if filepath.Dir(rel) == "pg_wal" {
				return filepath.SkipDir // archive_status, summaries: kept, but empty
			}
			return nil
		case d.Type()&fs.ModeSymlink != 0:
			return fmt.Errorf("%s is a symbolic link (a tablespace?), which the harness's backups do not follow", path)
		case !d.Type().IsRegular():
			return nil
		}
		return copyServiceFile(path, out)
	})
	if err != nil {
		return err
	}
	return copyControlFile(src, dst)
}

// copyServiceFile copies one file of a data directory, mode 0600 and owned
// by the service user, as initdb makes them.
func copyServiceFile(src, dst string) error {
	in, err := os.Open(src)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	defer func() { _ = in.Close() }()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		_ = out.Close()
		return err
	}
	if err := out.Close(); err != nil {
		return err
	}
	return chownService(dst)
}

// copyControlFile copies global/pg_control last, as pg_basebackup sends it,
// and guards against a torn read: the server rewrites the file in place
// (at checkpoints, for one) and a copy that caught half of a write fails
// its CRC check at startup. Two reads in a row that agree are a whole
// version of it.
func copyControlFile(src, dst string) error {
	path := filepath.Join(src, "global", "pg_control")
	prev, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	for range 100 {
		cur, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		if bytes.Equal(prev, cur) {
			return writeServiceFile(filepath.Join(dst, "global", "pg_control"), cur)
		}
		prev = cur
	}
	return fmt.Errorf("%s kept changing while it was read", path)
}
