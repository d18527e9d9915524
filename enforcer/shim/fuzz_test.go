package shim_test

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// The shim's parsers of what it reads from outside (MGPU_VISIBLE_DEVICES,
// the enforcer's attach responses) run in fuzz/'s harness, built with ASan
// and UBSan: one process per fuzzing worker answers input after input
// (fuzz/README.md), and a sanitizer report, a broken promise the harness
// checks itself (descriptors, buffer bounds) or a death fails the input.
// What the parsers return is checked here against what they document.

// harnessConsts are what the harness reports of the shim's headers.
type harnessConsts struct {
	respSize, maxProcs, fdRoom int
	magic, version             uint32
	msgOff, msgLen, maxDevices int
}

type harness struct {
	cmd    *exec.Cmd
	in     io.WriteCloser
	out    *bufio.Reader
	stderr *tailBuffer
	harnessConsts
}

// tailBuffer keeps the last 16 KiB written to it.
type tailBuffer struct {
	mu sync.Mutex
	b  []byte
}

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.b = append(t.b, p...)
	if n := len(t.b) - 16<<10; n > 0 {
		t.b = t.b[n:]
	}
	return len(p), nil
}

func (t *tailBuffer) String() string { t.mu.Lock(); defer t.mu.Unlock(); return string(t.b) }

var shimFuzz struct {
	build sync.Once
	path  string
	err   error
	mu    sync.Mutex
	h     *harness // nil: start one
}

// harnessCall runs one input (a target byte and its bytes) through the
// harness and returns the answer, starting the harness if none runs; a
// harness that dies or does not answer in time fails the test with what
// it printed.
func harnessCall(t *testing.T, input []byte) ([]byte, harnessConsts) {
	t.Helper()
	shimFuzz.build.Do(func() {
		dir := filepath.Join(root, "enforcer", "shim", "fuzz")
		build := filepath.Join(root, "build")
		shimFuzz.path = filepath.Join(build, "shim", "fuzz", "mgpu-shim-fuzz")
		if out, err := exec.Command("make", "-s", "-C", dir, "BUILD="+build).CombinedOutput(); err != nil { //nolint:gosec // fixed args
			shimFuzz.err = fmt.Errorf("building the fuzz harness: %w\n%s", err, out)
		}
	})
	if shimFuzz.err != nil {
		t.Fatal(shimFuzz.err)
	}
	shimFuzz.mu.Lock()
	defer shimFuzz.mu.Unlock()
	if shimFuzz.h == nil {
		h, err := startHarness(shimFuzz.path)
		if err != nil {
			t.Fatal(err)
		}
		shimFuzz.h = h
	}
	h := shimFuzz.h
	answer, err := h.call(input)
	if err != nil {
		shimFuzz.h = nil
		_ = h.cmd.Process.Kill()
		werr := h.cmd.Wait()
		t.Fatalf("the harness failed on input %q: %v (%v)\n%s", input, err, werr, h.stderr)
	}
	return answer, h.harnessConsts
}

func startHarness(path string) (*harness, error) {
	cmd := exec.Command(path) //nolint:gosec // the harness just built
	// The parsers allocate nothing: descriptors are what they could leak,
	// and the harness counts those itself.
	cmd.Env = append(os.Environ(), "ASAN_OPTIONS=detect_leaks=0", "UBSAN_OPTIONS=print_stacktrace=1")
	h := &harness{cmd: cmd, stderr: &tailBuffer{}}
	cmd.Stderr = h.stderr
	var err error
	if h.in, err = cmd.StdinPipe(); err != nil {
		return nil, err
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	h.out = bufio.NewReader(out)
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	hello, err := h.read()
	if err == nil {
		_, err = fmt.Sscanf(string(hello), "mgpu-shim-fuzz resp=%d max_procs=%d fd_room=%d magic=%d version=%d message=%d/%d max_devices=%d",
			&h.respSize, &h.maxProcs, &h.fdRoom, &h.magic, &h.version, &h.msgOff, &h.msgLen, &h.maxDevices)
	}
	if err != nil {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		return nil, fmt.Errorf("starting the harness: %w\n%s", err, h.stderr)
	}
	return h, nil
}

func (h *harness) read() ([]byte, error) {
	var n uint32
	if err := binary.Read(h.out, binary.LittleEndian, &n); err != nil {
		return nil, err
	}
	b := make([]byte, n)
	_, err := io.ReadFull(h.out, b)
	return b, err
}

// call sends one input and reads its answer, killing the harness if it
// takes more than 10 s.
func (h *harness) call(input []byte) ([]byte, error) {
	timer := time.AfterFunc(10*time.Second, func() { _ = h.cmd.Process.Kill() })
	defer timer.Stop()
	frame := binary.LittleEndian.AppendUint32(nil, uint32(len(input))) //nolint:gosec // inputs are far below 4 GiB
	if _, err := h.in.Write(append(frame, input...)); err != nil {
		return nil, err
	}
	return h.read()
}

// FuzzShimParseVisible checks parse_visible against MGPU_VISIBLE_DEVICES'
// documented form: a comma list of host indexes (decimal digits, at most
// 1000000), at most MGPU_MAX_DEVICES entries, nothing else; what it
// accepts is every entry, in order.
func FuzzShimParseVisible(f *testing.F) {
	for _, s := range []string{"0", "0,1", "1,0,3", "3", "", ",", "0,", ",0", "1,,2", "a", " 1", "1 ", "-1", "+1",
		"1000000", "1000001", "99999999999999999999", "0000000000000000000000000001", "0x1", "1\x002",
		strings.Repeat("0,", 63) + "0", strings.Repeat("0,", 64) + "0", strings.Repeat("9", 4096)} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		answer, hc := harnessCall(t, append([]byte{'v'}, s...))
		fields := strings.Fields(string(answer))
		if len(fields) < 2 {
			t.Fatalf("answer %q", answer)
		}
		want, ok := visibleWant(s, hc.maxDevices)
		if ok != (fields[0] == "0") {
			t.Fatalf("parse_visible(%q) returned %s, want ok %v (%v)", s, fields[0], ok, want)
		}
		if ok && strings.Join(fields[2:], ",") != want {
			t.Fatalf("parse_visible(%q) = %v, want %s", s, fields[2:], want)
		}
	})
}

// visibleWant is the list a valid MGPU_VISIBLE_DEVICES value (up to its
// first NUL, as an environment variable ends) means, comma-separated.
func visibleWant(s string, maxDevices int) (string, bool) {
	s, _, _ = strings.Cut(s, "\x00")
	parts := strings.Split(s, ",")
	if s == "" || len(parts) > maxDevices {
		return "", false
	}
	for i, p := range parts {
		if p == "" || strings.Trim(p, "0123456789") != "" {
			return "", false
		}
		if p = strings.TrimLeft(p, "0"); p == "" {
			p = "0"
		}
		if v, err := strconv.ParseUint(p, 10, 32); err != nil || v > 1000000 {
			return "", false
		}
		parts[i] = p
	}
	return strings.Join(parts, ","), true
}

// attachResp is an attach response of the harness's layout.
func attachResp(c harnessConsts, magic, version uint32, status int32, message string) []byte {
	b := make([]byte, c.respSize)
	binary.LittleEndian.PutUint32(b[0:], magic)
	binary.LittleEndian.PutUint32(b[4:], version)
	binary.LittleEndian.PutUint32(b[8:], uint32(status)) //nolint:gosec // the wire's two's complement
	copy(b[c.msgOff:c.msgOff+c.msgLen], message)
	return b
}

// The layout of protocol 2's response (mgpu_region.h), for the seeds; the
// harness reports the real one, which the checks use.
var seedConsts = harnessConsts{respSize: 256, magic: 0x4150474d, version: 2, msgOff: 32, msgLen: 224}

// FuzzShimCheckResp checks check_resp on any response and error buffer:
// it accepts exactly an OK of this magic and version, and otherwise fills
// err with its one line, truncated to the buffer: a refusal's message up
// to its first NUL or the end of the field (line breaks as spaces,
// "refused" for none), or what is wrong with magic or version.
func FuzzShimCheckResp(f *testing.F) {
	c := seedConsts
	for _, r := range [][]byte{
		attachResp(c, c.magic, c.version, 0, ""),
		attachResp(c, c.magic, c.version, 1, "mgpu: pid 42 is in no instance of GPU 0\n"),
		attachResp(c, c.magic, c.version, 4, "two\r\nlines"),
		attachResp(c, c.magic, c.version, 2, strings.Repeat("m", 300)),
		attachResp(c, c.magic, 1, 3, "the enforcer speaks attach protocol 2, this shim 1"),
		attachResp(c, c.magic, 3, 0, ""),
		attachResp(c, c.magic, 3, -1, "\n"),
		attachResp(c, 0x5550474d, c.version, 0, ""),
		attachResp(c, c.magic, c.version, 0, "")[:12],
		nil,
	} {
		f.Add(r, uint16(255))
	}
	f.Add(attachResp(c, c.magic, c.version, 1, "a longer message than the buffer"), uint16(7))
	f.Add(attachResp(c, c.magic, 9, 0, ""), uint16(0))
	f.Fuzz(func(t *testing.T, resp []byte, errSel uint16) {
		answer, hc := harnessCall(t, append(append([]byte{'c'}, byte(errSel), byte(errSel>>8)), resp...))
		rc, errText, _ := strings.Cut(string(answer), "\n")
		full := make([]byte, hc.respSize)
		copy(full, resp)
		want := checkWant(hc, full)
		if rc != "0" && rc != "-1" || (rc == "0") != (want == "") {
			t.Fatalf("check_resp returned %s (%q), want the error %q", rc, errText, want)
		}
		if errlen := 1 + int(errSel)%512; len(want) > errlen-1 {
			want = want[:errlen-1]
		}
		if rc == "-1" && (errText != want || strings.ContainsAny(errText, "\r\n")) {
			t.Fatalf("check_resp's error %q, want %q", errText, want)
		}
	})
}

// checkWant is check_resp's error for a response, "" for none.
func checkWant(c harnessConsts, b []byte) string {
	magic := binary.LittleEndian.Uint32(b[0:])
	version := binary.LittleEndian.Uint32(b[4:])
	status := binary.LittleEndian.Uint32(b[8:])
	switch {
	case magic != c.magic:
		return "not an mgpu enforcer (bad response magic)"
	case status != 0:
		msg, _, _ := bytes.Cut(b[c.msgOff:c.msgOff+c.msgLen-1], []byte{0})
		msg = bytes.ReplaceAll(bytes.ReplaceAll(msg, []byte("\n"), []byte(" ")), []byte("\r"), []byte(" "))
		if len(msg) == 0 {
			return "refused"
		}
		return string(msg)
	case version != c.version:
		return fmt.Sprintf("the enforcer speaks attach protocol %d, this shim %d: install the libmgpu-shim.so of the enforcer's release", version, c.version)
	}
	return ""
}

// readSeg is one write of a read_resp input: bytes and descriptors.
type readSeg struct {
	data []byte
	fds  int
}

// readSegs decodes a read_resp input's writes as the harness does
// (harness.c, run_read).
func readSegs(in []byte) []readSeg {
	var segs []readSeg
	sent, n := 0, 0
	for len(in) >= 2 && n < 64 {
		fds, l := min(int(in[0]), 253), min(int(in[1]), len(in)-2)
		data := in[2 : 2+l]
		in = in[2+l:]
		n++
		if l == 0 {
			continue
		}
		if sent+fds > 512 {
			fds = 0
		}
		sent += fds
		segs = append(segs, readSeg{data, fds})
	}
	return segs
}

// readInput encodes writes as a read_resp input.
func readInput(segs ...readSeg) []byte {
	var b []byte
	for _, s := range segs {
		for len(s.data) > 255 {
			b = append(append(b, byte(s.fds), 255), s.data[:255]...)
			s.data, s.fds = s.data[255:], 0
		}
		b = append(append(b, byte(s.fds), byte(len(s.data))), s.data...)
	}
	return b
}

// FuzzShimReadResp writes any bytes and descriptors, in any pieces, to a
// socket for read_resp (harness.c): it reads exactly the first response's
// bytes, keeps the descriptors that came with them up to max (closing the
// others) with close-on-exec set, and fails when the connection ends
// early or more descriptors came in one piece than its buffer holds, then
// with nothing left open and err saying which.
func FuzzShimReadResp(f *testing.F) {
	c := seedConsts
	ok := attachResp(c, c.magic, c.version, 0, "")
	f.Add(uint8(2), uint8(255), readInput(readSeg{ok, 2}))
	f.Add(uint8(128), uint8(255), readInput(readSeg{ok[:1], 5}, readSeg{ok[1:], 0}))
	f.Add(uint8(1), uint8(255), readInput(readSeg{ok[:100], 1}, readSeg{ok[100:200], 1}, readSeg{ok[200:], 1}, readSeg{[]byte("more"), 3}))
	f.Add(uint8(128), uint8(255), readInput(readSeg{ok[:10], 129}, readSeg{ok[10:], 0}))
	f.Add(uint8(128), uint8(255), readInput(readSeg{ok[:10], 128}, readSeg{ok[10:], 2}))
	f.Add(uint8(0), uint8(40), readInput(readSeg{ok[:255], 2}))
	f.Add(uint8(2), uint8(255), readInput(readSeg{ok, 0}, readSeg{nil, 2}))
	f.Add(uint8(2), uint8(0), []byte{})
	f.Fuzz(func(t *testing.T, maxSel, errSel uint8, writes []byte) {
		answer, hc := harnessCall(t, append([]byte{'r', maxSel, errSel}, writes...))
		head, rest, _ := strings.Cut(string(answer), "\n")
		var rc, nfds int
		if _, err := fmt.Sscanf(head, "%d %d", &rc, &nfds); err != nil {
			t.Fatalf("answer %q", answer)
		}
		maxFDs, errlen := int(maxSel)%(hc.maxProcs+1), 1+int(errSel)
		var stream []byte
		fds, tooMany := 0, false
		for _, s := range readSegs(writes) {
			if len(stream) < hc.respSize { // read_resp reads this write
				fds += s.fds
				tooMany = tooMany || s.fds > hc.fdRoom
			}
			stream = append(stream, s.data...)
		}
		var want string
		switch {
		case tooMany:
			want = "the response's file descriptors did not fit (too many, or the process is at its open-file limit)"
		case len(stream) < hc.respSize:
			want = fmt.Sprintf("the enforcer closed the connection after %d of %d bytes", len(stream), hc.respSize)
		}
		if want != "" {
			if len(want) > errlen-1 {
				want = want[:errlen-1]
			}
			if rc != -1 || nfds != 0 || rest != want {
				t.Fatalf("read_resp: %d, %d descriptors, %q; want the error %q", rc, nfds, rest, want)
			}
			return
		}
		if rc != 0 || nfds != min(fds, maxFDs) || rest != hex.EncodeToString(stream[:hc.respSize]) {
			t.Fatalf("read_resp: %d, %d descriptors, %q; want %d descriptors (max %d) and %x", rc, nfds, rest,
				min(fds, maxFDs), maxFDs, stream[:hc.respSize])
		}
	})
}
