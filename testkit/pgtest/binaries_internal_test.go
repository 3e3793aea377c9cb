package pgtest

import (
	"context"
	"io/fs"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestWantedVersion(t *testing.T) {
	for _, tc := range []struct {
		env     string
		want    int
		release string
		bad     bool
	}{
		{env: "", want: 0},
		{env: "15", want: 15},
		{env: " 16 ", want: 16, release: zonkyReleases[16]},
		{env: "17", want: 17, release: zonkyReleases[17]},
		{env: "18", want: 18, release: zonkyReleases[18]},
		{env: "18.1.0", want: 18, release: "18.1.0"},
		{env: "15.4.0", bad: true}, // 15 is Debian's, no release to pick
		{env: "14", bad: true},
		{env: "19", bad: true},
		{env: "18.1", bad: true},
		{env: "18.x.0", bad: true},
		{env: "latest", bad: true},
	} {
		t.Run(tc.env, func(t *testing.T) {
			t.Setenv(versionEnv, tc.env)
			want, release, err := wantedVersion()
			if tc.bad {
				require.ErrorContains(t, err, "want 15, 16, 17 or 18")
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, want)
			require.Equal(t, tc.release, release)
		})
	}
}

// The backup leaves out what pg_basebackup leaves out, and keeps the
// directories and timeline history a standby needs.
func TestBaseBackupSkips(t *testing.T) {
	for rel, dir := range map[string]bool{
		"postmaster.pid":                          false,
		"postmaster.opts":                         false,
		"standby.signal":                          false,
		"backup_label":                            false,
		"global/pg_control":                       false, // copied last, on its own
		"global/pg_internal.init":                 false,
		"base/5/pg_internal.init.123":             false,
		"base/5/pg_filenode.map.tmp":              false,
		"base/pgsql_tmp/pgsql_tmp123.0":           false,
		"pg_wal/000000010000000000000003":         false,
		"pg_wal/000000010000000000000003.partial": false,
		"pg_replslot/replica1":                    true,
		"pg_dynshmem/mmap.1234":                   false,
		"pg_stat_tmp/global.stat":                 false,
		"pg_subtrans/0000":                        false,
	} {
		require.True(t, skip(rel, dir), "%s is left out", rel)
	}
	for rel, dir := range map[string]bool{
		"PG_VERSION":                       false,
		"postgresql.conf":                  false,
		"postgresql.auto.conf":             false,
		"global/pg_filenode.map":           false,
		"base/5/1259":                      false,
		"base/pgsql_tmp":                   true,
		"pg_xact/0000":                     false,
		"pg_wal":                           true,
		"pg_wal/archive_status":            true,
		"pg_wal/summaries":                 true,
		"pg_wal/00000002.history":          false,
		"pg_replslot":                      true,
		"pg_dynshmem":                      true,
		"pg_stat/pgstat.stat":              false,
		"pg_logical/replorigin_checkpoint": false,
	} {
		require.False(t, skip(rel, dir), "%s is copied", rel)
	}
}

// A release resolved once is found again by a stat, and what was unpacked
// is readable and, where it should be, runnable by any user: the harness
// runs PostgreSQL as an unprivileged one when it is root.
func TestResolvedReleaseIsCachedAndOpen(t *testing.T) {
	_, release, err := wantedVersion()
	require.NoError(t, err)
	if release == "" {
		t.Skipf("%s=%q selects Debian's binaries: nothing comes from Maven Central", versionEnv, os.Getenv(versionEnv))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	dir, err := resolveZonky(ctx, release, t.Logf)
	require.NoError(t, err)
	began := time.Now()
	again, err := resolveZonky(ctx, release, t.Logf)
	require.NoError(t, err)
	require.Equal(t, dir, again)
	require.Less(t, time.Since(began), 100*time.Millisecond, "a second resolution is a stat of the marker")

	err = filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.Type()&fs.ModeSymlink != 0 {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		perm := fi.Mode().Perm()
		switch {
		case d.IsDir():
			require.Equal(t, fs.FileMode(0o755), perm, path)
		case filepath.Base(filepath.Dir(path)) == "bin":
			require.Equal(t, fs.FileMode(0o755), perm, path)
		default:
			require.Equal(t, fs.FileMode(0o004), perm&0o004, "%s is readable by others (%v)", path, perm)
		}
		return nil
	})
	require.NoError(t, err)
}
