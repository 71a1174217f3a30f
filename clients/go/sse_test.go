// The server-sent events reader (sse.go): the SSE grammar's comments, fields and multi-line
// data, the end at data: [DONE] (and without it, an incomplete stream), lines too long, line
// ends at CR, LF or CRLF however the reads split them, an event returned as soon as the read
// that completed it, a stream framed by bare CRs reaching the caller event by event, and a
// leading byte order mark.

package kvgate

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"testing/iotest"
	"time"
)

func TestSSEReader(t *testing.T) {
	in := ": comment\n\ndata: a\ndata: b\n\nevent: x\ndata:c\r\n\r\nid: 3\n\n\ndata: last"
	if got := readEvents(t, newSSEReader(strings.NewReader(in+"\n\ndata: [DONE]"))); strings.Join(got, "|") != "a\nb|c|last" {
		t.Fatalf("%q", got)
	}
	// The same events without [DONE]: all delivered, then the end is an error, not io.EOF.
	r := newSSEReader(strings.NewReader(in))
	for _, want := range []string{"a\nb", "c", "last"} {
		if d, err := r.next(); d != want || err != nil {
			t.Fatalf("want %q: %q %v", want, d, err)
		}
	}
	for i := 0; i < 2; i++ {
		if _, err := r.next(); !errors.Is(err, ErrIncompleteStream) {
			t.Fatal(err)
		}
	}
	r = newSSEReader(strings.NewReader("data: x\n\ndata: [DONE]\n\ndata: after\n\n"))
	if d, _ := r.next(); d != "x" {
		t.Fatal(d)
	}
	if _, err := r.next(); err != io.EOF {
		t.Fatal(err)
	}
	if _, err := r.next(); err != io.EOF {
		t.Fatal("events after [DONE] are not read")
	}
	r = newSSEReader(strings.NewReader("data: " + strings.Repeat("x", maxSSELine+1) + "\n\n"))
	if _, err := r.next(); !errors.Is(err, errLineTooLong) {
		t.Fatal(err)
	}
}

// readEvents is every event's data until the end of the stream (or [DONE]).
func readEvents(t *testing.T, r *sseReader) []string {
	t.Helper()
	var got []string
	for {
		d, err := r.next()
		if err == io.EOF {
			return got
		}
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, d)
	}
}

// The SSE grammar ends a line at CR, LF or CRLF; events framed any of these ways, split
// anywhere (one byte per read included), read the same.
func TestSSEReaderLineEnds(t *testing.T) {
	for _, in := range []string{
		"data: a\r\rdata: b1\rdata: b2\r\r: c\r\rdata: [DONE]\r\rdata: after\r\r",
		"data: a\r\n\r\ndata: b1\r\ndata: b2\n\r: c\n\ndata: [DONE]\r\n\r\n",
		"data: a\n\ndata: b1\rdata: b2\r\n\n: c\r\rdata: [DONE]\n\n",
	} {
		for _, r := range []io.Reader{strings.NewReader(in), iotest.OneByteReader(strings.NewReader(in))} {
			if got := readEvents(t, newSSEReader(r)); strings.Join(got, "|") != "a|b1\nb2" {
				t.Fatalf("%q: %q", in, got)
			}
		}
	}
}

// stalling serves its chunks one per read, then blocks, as a server that waits does.
type stalling struct {
	chunks []string
	stop   chan struct{}
}

func (r *stalling) Read(p []byte) (int, error) {
	if len(r.chunks) == 0 {
		<-r.stop
		return 0, io.EOF
	}
	n := copy(p, r.chunks[0])
	r.chunks = r.chunks[1:]
	return n, nil
}

// The CR of a CRLF ends one read and its LF starts the next, which also holds the blank line
// that ends the event: the event is returned from what was read, without waiting for more
// (skipping the LF alone made the scanner read again first, and the event waited for the
// server's next write).
func TestAnEventWhoseCRLFIsSplitBetweenReadsIsNotHeldBack(t *testing.T) {
	r := &stalling{chunks: []string{"data: b\r", "\n\r\n"}, stop: make(chan struct{})}
	defer close(r.stop)
	got := make(chan string, 1)
	go func() {
		data, _ := newSSEReader(r).next()
		got <- data
	}()
	select {
	case data := <-got:
		if data != "b" {
			t.Fatalf("%q", data)
		}
	case <-time.After(chunkWait):
		t.Fatal("the event waited for a read after the one that completed it")
	}
}

// A stream framed by bare CRs reaches the caller event by event, each as soon as the CR that
// ends it has arrived (the server writes nothing more until the test asks), and a CRLF split
// between two writes is one line end.
func TestStreamFramedByBareCRChunkByChunk(t *testing.T) {
	next := make(chan struct{})
	event := func(text string) string {
		return `data: {"choices": [{"index": 0, "delta": {"content": "` + text + `"}}]}`
	}
	writes := []string{event("a") + "\r\r", event("b") + "\r", "\n\r\n: keep-alive\r" + event("c") + "\r\r", "data: [DONE]\r\r"}
	g := newFakeGateway(t, func(w http.ResponseWriter, body map[string]interface{}, n int) {
		w.Header().Set("Content-Type", "text/event-stream")
		for i, chunk := range writes {
			if i > 0 {
				select {
				case <-next:
				case <-time.After(chunkWait):
					return
				}
			}
			fmt.Fprint(w, chunk)
			w.(http.Flusher).Flush()
		}
	})
	stream, err := newTestClient(t, g, newFakeClock()).ChatCompletionStream(context.Background(), ChatCompletionRequest{Model: "m"})
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Close()
	send := func() {
		select {
		case next <- struct{}{}:
		case <-time.After(chunkWait):
			t.Fatal("the server stopped waiting for the client")
		}
	}
	if chunk, err := recvWithin(t, stream); err != nil || chunk.Choices[0].Delta.Content != "a" {
		t.Fatalf("%+v %v", chunk, err)
	}
	send()
	send()
	for _, want := range []string{"b", "c"} {
		if chunk, err := recvWithin(t, stream); err != nil || chunk.Choices[0].Delta.Content != want {
			t.Fatalf("want %q: %+v %v", want, chunk, err)
		}
	}
	send()
	if _, err := recvWithin(t, stream); err != io.EOF {
		t.Fatal(err)
	}
}

// The SSE grammar allows a byte order mark before the stream's first line; left on that line it
// would hide the first event's field name, and the first chunk would be lost. The Python SDK
// strips it too; a later one is no BOM but part of its line.
func TestALeadingByteOrderMarkIsNotPartOfTheFirstEvent(t *testing.T) {
	in := "\ufeffdata: a\n\n\ufeffdata: b\n\ndata: c\n\ndata: [DONE]\n\n"
	for _, r := range []io.Reader{strings.NewReader(in), iotest.OneByteReader(strings.NewReader(in))} {
		if got := readEvents(t, newSSEReader(r)); strings.Join(got, "|") != "a|c" {
			t.Fatalf("%q", got)
		}
	}
	g := newFakeGateway(t, func(w http.ResponseWriter, body map[string]interface{}, n int) {
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, "\ufeffdata: {\"choices\": [{\"index\": 0, \"delta\": {\"content\": \"first\"}}]}\n\ndata: [DONE]\n\n")
	})
	stream, err := newTestClient(t, g, newFakeClock()).ChatCompletionStream(context.Background(), ChatCompletionRequest{Model: "m"})
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Close()
	if chunk, err := stream.Recv(); err != nil || len(chunk.Choices) != 1 || chunk.Choices[0].Delta.Content != "first" {
		t.Fatalf("%+v %v", chunk, err)
	}
	if _, err := stream.Recv(); err != io.EOF {
		t.Fatal(err)
	}
}
