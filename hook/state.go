package hook

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	oci "github.com/opencontainers/runtime-spec/specs-go"
)

// Size limits of what the hook reads. An OCI state is a few hundred bytes;
// a config.json rarely exceeds a few hundred KiB.
const (
	MaxStateBytes  = 64 << 10
	MaxConfigBytes = 8 << 20
	maxIDLen       = 1024
)

// ErrTooLarge is returned (wrapped) for input over its size limit.
var ErrTooLarge = errors.New("too large")

// ParseState decodes the OCI state a runtime writes on a hook's stdin. It
// reads at most MaxStateBytes, accepts one JSON object and nothing after it,
// and requires a valid container id and an absolute bundle path. The pid is
// checked by the caller (createRuntime needs one, poststop may have none).
func ParseState(r io.Reader) (*oci.State, error) {
	data, err := readBounded(r, MaxStateBytes)
	if err != nil {
		return nil, fmt.Errorf("read OCI state from stdin: %w", err)
	}
	var st oci.State
	if err := decodeStrict(data, &st); err != nil {
		return nil, fmt.Errorf("OCI state on stdin: %w", err)
	}
	if err := ValidateID(st.ID); err != nil {
		return nil, fmt.Errorf("OCI state on stdin: %w", err)
	}
	if st.Pid < 0 {
		return nil, fmt.Errorf("OCI state on stdin: pid %d is negative", st.Pid)
	}
	if st.Bundle == "" || !filepath.IsAbs(st.Bundle) {
		return nil, fmt.Errorf("OCI state on stdin: bundle %q is not an absolute path", st.Bundle)
	}
	return &st, nil
}

// ValidateID checks a container id: 1..1024 bytes of letters, digits and
// "_+-." (runc's rule), and not "." or "..".
func ValidateID(id string) error {
	if id == "" {
		return errors.New("container id is empty")
	}
	if len(id) > maxIDLen {
		return fmt.Errorf("container id is %d bytes long (at most %d)", len(id), maxIDLen)
	}
	if id == "." || id == ".." {
		return fmt.Errorf("container id %q is not valid", id)
	}
	for i := 0; i < len(id); i++ {
		c := id[i]
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9', c == '_', c == '+', c == '-', c == '.':
		default:
			return fmt.Errorf("container id %q has a character other than letters, digits and \"_+-.\"", id)
		}
	}
	return nil
}

// LoadBundle reads <bundle>/config.json (at most MaxConfigBytes): the
// parts the hook uses, the process's environment, the mounts and the
// annotations. Decoding only these (the rest is skipped unparsed) saves
// most of the 2 ms the whole OCI spec took at every container start.
func LoadBundle(bundle string) (*oci.Spec, error) {
	path := filepath.Join(bundle, "config.json")
	f, err := os.Open(path) //nolint:gosec // the bundle path comes from the runtime
	if err != nil {
		return nil, fmt.Errorf("read the container's config: %w", err)
	}
	defer func() { _ = f.Close() }()
	data, err := readBounded(f, MaxConfigBytes)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", path, err)
	}
	var used struct {
		Process *struct {
			Env []string `json:"env"`
		} `json:"process"`
		Mounts []struct {
			Destination string `json:"destination"`
			Source      string `json:"source"`
		} `json:"mounts"`
		Annotations map[string]string `json:"annotations"`
	}
	if err := decodeStrict(data, &used); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	spec := &oci.Spec{Annotations: used.Annotations}
	if used.Process != nil {
		spec.Process = &oci.Process{Env: used.Process.Env}
	}
	for _, m := range used.Mounts {
		spec.Mounts = append(spec.Mounts, oci.Mount{Destination: m.Destination, Source: m.Source})
	}
	return spec, nil
}

// Annotations returns the container's annotations: config.json's, and the
// state's for keys config.json lacks (the runtime copies them, so they
// agree).
func Annotations(st *oci.State, spec *oci.Spec) map[string]string {
	out := make(map[string]string, len(spec.Annotations)+len(st.Annotations))
	for k, v := range st.Annotations {
		out[k] = v
	}
	for k, v := range spec.Annotations {
		out[k] = v
	}
	return out
}

func readBounded(r io.Reader, limit int64) ([]byte, error) {
	data, err := io.ReadAll(io.LimitReader(r, limit+1))
	if err != nil {
		return nil, err
	}
	if int64(len(data)) > limit {
		return nil, fmt.Errorf("%w: more than %d bytes", ErrTooLarge, limit)
	}
	return data, nil
}

// decodeStrict decodes exactly one JSON value and rejects anything but
// white space after it. Unknown fields are allowed (newer runtime-spec
// versions add some).
func decodeStrict(data []byte, v any) error {
	if len(bytes.TrimSpace(data)) == 0 {
		return errors.New("empty input (want a JSON object)")
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	if err := dec.Decode(v); err != nil {
		return fmt.Errorf("invalid JSON: %w", err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return errors.New("invalid JSON: data after the object")
	}
	return nil
}

// initRecordName is the file create leaves in the container's bundle: the
// pid and start time of the init it admitted. The state a runtime gives
// destroy has the init's pid but no start time, and at poststop that pid
// may already be another process's (the init has exited); the record lets
// destroy tell its own init from a process that reuses the pid. The bundle
// is the runtime's directory on the host, out of the container's reach,
// and unique to the container where its id may not be (containerd puts it
// under the namespace).
const initRecordName = "mgpu-hook.init"

// maxInitRecord bounds what readInitRecord reads: two decimal numbers.
const maxInitRecord = 64

// writeInitRecord records id's pid and start time in bundle.
func writeInitRecord(bundle string, id Identity) error {
	path := filepath.Join(bundle, initRecordName)
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC|syscall.O_NOFOLLOW, 0o600) //nolint:gosec // the bundle path comes from the runtime
	if err != nil {
		return err
	}
	_, err = fmt.Fprintf(f, "%d %d\n", id.Pid, id.StartTime)
	return errors.Join(err, f.Close())
}

// readInitRecord reads what writeInitRecord recorded in bundle; false when
// there is no valid record (no bundle, a create that admitted nothing).
func readInitRecord(bundle string) (Identity, bool) {
	f, err := os.OpenFile(filepath.Join(bundle, initRecordName), os.O_RDONLY|syscall.O_NOFOLLOW, 0) //nolint:gosec // the bundle path comes from the runtime
	if err != nil {
		return Identity{}, false
	}
	defer func() { _ = f.Close() }()
	data, err := readBounded(f, maxInitRecord)
	if err != nil {
		return Identity{}, false
	}
	return parseInitRecord(data)
}

// parseInitRecord parses "<pid> <start time>\n".
func parseInitRecord(data []byte) (Identity, bool) {
	fields := strings.Fields(string(data))
	if len(fields) != 2 || !bytes.HasSuffix(data, []byte("\n")) {
		return Identity{}, false
	}
	pid, err := strconv.Atoi(fields[0])
	if err != nil || pid <= 0 {
		return Identity{}, false
	}
	start, err := strconv.ParseUint(fields[1], 10, 64)
	if err != nil {
		return Identity{}, false
	}
	return Identity{Pid: pid, StartTime: start}, true
}
